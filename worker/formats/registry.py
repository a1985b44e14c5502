"""The weight formats by ``--weights`` name, ``auto`` resolved, and every invalid combination refused:
all in :func:`resolve`, the one place.

A :class:`WeightFormat` says, per layout ("cpu": torch's and our CPU packs; "groups": the Triton
kernel's), which schemes (worker/formats/scheme.py) hold a model's linears, its LM head and its
embedding, each list tried in order (the first whose ``supports`` holds takes the module); on which
devices it runs; what it needs there; and what it does to the model before packing (w8a8 smooths).

Adding a format: a module declaring its scheme(s) and a ``WeightFormat``, and one line in
:data:`FORMATS` (or :func:`register` at run time: tests/test_weight_formats.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import structlog
import torch
from torch import nn

from kernels import cpu_gemv
from kernels.cpu_gemv import int8_gemv_kernel, load as load_cpu_gemv
from worker.formats.groups import Group4Linear, GroupQuantLinear
from worker.formats.int4 import Int4Linear
from worker.formats.int8 import Int8A8Linear, Int8Embedding, Int8Linear
from worker.formats.scheme import GGUF_BLOCK, Scheme, Switches, WeightConfig
from worker.formats.w4a8 import Q4A8Linear
from worker.formats.w8a8 import Int8DynamicLinear

log = structlog.get_logger(__name__)

AUTO = "auto"
_TWO_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class Layout:
    """The schemes of one layout, each list tried in order."""
    linear: tuple[type[Scheme], ...]
    head: tuple[type[Scheme], ...]
    embedding: tuple[type[Scheme], ...] = (Int8Embedding,)


@dataclass(frozen=True, slots=True, eq=False)
class WeightFormat:
    name: str
    help: str
    devices: tuple[str, ...] = ()  # device types it serves; () any (fp32)
    device_note: str = "quantized kernels exist for CPU and CUDA"  # said when the device is not one of them
    layouts: dict[str, Layout] = field(default_factory=dict)  # {}: nothing is swapped (fp32)
    group: int | None = None  # the only group it takes (w4a8: Q4_1's 32); None: any
    requires: Callable[[WeightConfig], None] | None = None  # raises ValueError saying what is missing here
    # before packing (w8a8: smoothing): (model, config, load_tokenizer) -> how many linears it changed
    prepare: Callable[[nn.Module, WeightConfig, Callable | None], int] | None = None


def _needs_cpu_operators(cfg: WeightConfig) -> None:
    try:
        load_cpu_gemv()
    except (RuntimeError, OSError) as e:
        raise ValueError(f"--weights {cfg.weights} needs our CPU operators (kernels/cpu_gemv.py), which did not "
                         f"build here: {e}") from e


def _smooth(model: nn.Module, cfg: WeightConfig, load_tokenizer: Callable | None) -> int:
    """w8a8 first folds its activations' range into the weights, calibrated on text in the model's
    tokenizer (worker/smoothing.py): it runs a nested model's tiers."""
    from worker.smoothing import calibration_windows, input_amax, smooth  # noqa: PLC0415
    if not hasattr(model, "exit_hidden"):
        raise ValueError(f"--weights w8a8 smooths a nested model's activations; got {type(model).__name__}")
    windows = calibration_windows(load_tokenizer() if load_tokenizer else None, model.cfg.vocab_size)
    return smooth(model, input_amax(model, windows))


FP32 = WeightFormat("fp32", "as loaded")
INT8 = WeightFormat("int8", "int8 per channel", _TWO_DEVICES, layouts={
    "cpu": Layout((Int8Linear,), (Int8Linear,)), "groups": Layout((GroupQuantLinear,), (GroupQuantLinear,))})
INT4 = WeightFormat("int4", "int4 in groups of 32 (a GGUF's own Q4_1 blocks where they match)", _TWO_DEVICES, layouts={
    "cpu": Layout((Int4Linear, Int8Linear), (Int8Linear,)), "groups": Layout((Group4Linear,), (GroupQuantLinear,))})
W8A8 = WeightFormat("w8a8", "int8 weights times int8 activations (fbgemm: cheap extra rows, for batches)",
                    ("cpu",), "fbgemm's int8 kernels are CPU only",
                    {"cpu": Layout((Int8DynamicLinear,), (Int8DynamicLinear,))}, prepare=_smooth)
W4A8 = WeightFormat("w4a8", "Q4_1 blocks times activations quantized per 32 as llama.cpp does (the fastest "
                    "on CPUs with AVX2 or AVX-512)", ("cpu",), "its kernel is for CPUs with AVX2",
                    {"cpu": Layout((Q4A8Linear, Int8Linear), (Int8A8Linear, Int8Linear))}, group=GGUF_BLOCK,
                    requires=_needs_cpu_operators)

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (FP32, INT8, INT4, W8A8, W4A8)}


def register(fmt: WeightFormat) -> None:
    """Adds a format under its name (a second one under a taken name is refused)."""
    if fmt.name == AUTO or fmt.name in FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt


def names() -> tuple[str, ...]:
    """What ``--weights`` accepts."""
    return (AUTO, *FORMATS)


def parse_weights(name: str) -> str:
    """``--weights``'s argparse type: a registered name or auto (ValueError listing them otherwise)."""
    if name not in names():
        raise ValueError(f"--weights {name!r}: expected one of {', '.join(names())}")
    return name


_auto_logged = False


def auto_choice(device: str = "cpu") -> str:
    """What ``auto`` means on this device and ISA: on a CPU where torch reports AVX2 or AVX-512, w4a8
    where our int8 operator serves (the fastest for one request and for batches on both machines:
    docs/BENCHMARKS.md), else int4 (torch's int4 kernel); else fp32. On CUDA dense weights (fp32 here;
    the autocast decides bf16): the one H200 run measured dense bf16 at 1,240-2,534 GB/s on the 1B
    shapes and the old int4 kernel at 40-61 GB/s (../shared/gpu-runs/2026-12-04). int4 streams 5/16 of
    bf16's bytes, so it wins only above ~0.31x dense's bandwidth (~790 GB/s there) and only once a run
    shows the redesigned kernel (issue 43) within its error bound: until then int4 / int8 must be asked
    for. Logged once per process."""
    global _auto_logged
    cap = torch.backends.cpu.get_cpu_capability()
    choice = "fp32"
    if str(device).startswith("cpu") and cap in ("AVX2", "AVX512"):
        choice = "w4a8" if int8_gemv_kernel() is not None else "int4"
    if not _auto_logged:
        log.info("weights auto", choice=choice, cpu_capability=cap, device=str(device))
        _auto_logged = True
    return choice


def weights_why(asked: str, device: str = "cpu") -> str:
    """Why ``--weights asked`` serves what it serves, for a start line and the status page: the flag as
    given, or ``auto`` with the CPU capability, and, where auto fell back from w4a8, why our CPU operators
    are unavailable."""
    if asked != AUTO:
        return f"--weights {asked}"
    cap = torch.backends.cpu.get_cpu_capability()
    if auto_choice(device) == "int4":
        why = cpu_gemv.unavailable.get("int8_gemv", "unknown")
        return f"auto on {cap}: not w4a8, our CPU operators are unavailable ({why[:300]})"
    return f"auto on {cap}"


def schemes(fmt: WeightFormat, layout: str) -> tuple[type[Scheme], ...]:
    plan = fmt.layouts.get(layout)
    return () if plan is None else (*plan.linear, *plan.head, *plan.embedding)


def compile_refusal(scheme_names: list[str], weights: str = "") -> str:
    """The message for a compiled path asked of schemes that an inductor graph cannot hold."""
    named = f" --weights {weights}" if weights else ""
    return (f"--compile does not serve{named} (its schemes {', '.join(scheme_names)} break the compiled graph: "
            f"it runs eager)")


def resolve(weights: str, device: str = "cpu", layout: str | None = None, group: int = GGUF_BLOCK,
            switches: Switches | None = None, compile: bool = False) -> WeightConfig:
    """The one place a ``--weights`` request is checked: the name (``auto`` resolved here), the device,
    the layout (None: "groups" on CUDA, "cpu" elsewhere), the group, what the format needs on this
    machine and, with ``compile``, whether its CPU schemes can all be compiled. ValueError says what is
    wrong."""
    fmt = FORMATS.get(auto_choice(device) if weights == AUTO else parse_weights(weights))
    dev = str(device)
    if fmt.devices and not dev.startswith(fmt.devices):
        raise ValueError(f"--weights {fmt.name}: {fmt.device_note}, not {dev}")
    layout = layout or ("groups" if dev.startswith("cuda") else "cpu")
    if layout not in ("cpu", "groups") or (fmt.layouts and layout not in fmt.layouts):
        known = ", ".join(fmt.layouts or ("cpu", "groups"))
        raise ValueError(f"--weights {fmt.name}: layout {layout!r}, expected one of {known}")
    if fmt.group is not None and group != fmt.group:
        raise ValueError(f"--weights {fmt.name} uses Q4_1's blocks of {fmt.group} inputs; group {group} was asked")
    stuck = sorted({s.name for s in schemes(fmt, layout) if not s.compilable})
    if compile and stuck and not dev.startswith("cuda"):
        raise ValueError(compile_refusal(stuck, fmt.name))
    cfg = WeightConfig(fmt.name, dev, layout, group, switches or Switches.from_env())
    if fmt.requires is not None:
        fmt.requires(cfg)
    return cfg


def resolve_mode(mode: str, device: str = "cpu") -> str:
    """The format ``--weights mode`` serves on ``device`` (``auto`` resolved), checked as :func:`resolve`."""
    return resolve(mode, device).weights


__all__ = ["AUTO", "FORMATS", "Layout", "WeightFormat", "auto_choice", "compile_refusal", "schemes", "names", "parse_weights", "register",
           "resolve", "resolve_mode", "weights_why"]
