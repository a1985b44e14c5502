"""The weight formats by ``--weights`` name, ``auto`` resolved, and every invalid combination refused:
all in :func:`resolve`, the one place.

Each format's module declares its :class:`~worker.formats.weightformat.WeightFormat` (``FORMAT``);
adding one is that module and one :func:`register` line at the end of this file (or a call at run time:
tests/test_weight_formats.py). ``--weights`` lists them in the order they are registered."""
from __future__ import annotations

from pathlib import Path

import structlog
import torch

from kernels import cpu_gemv
from kernels.cpu_gemv import int8_gemv_kernel
from worker.formats import (  # the formats' modules, one a line
    fp32,
    int4,
    int8,
    kquant,
    w4a8,
    w8a8,
)
from kernels.switches import Switches, current as current_switches
from worker.formats.scheme import GGUF_BLOCK, WeightConfig
from worker.formats.weightformat import WeightFormat

log = structlog.get_logger(__name__)

AUTO = "auto"
FORMATS: dict[str, WeightFormat] = {}


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


def may_quantize(weights: str) -> bool:
    """Whether ``--weights weights`` may swap a loaded model's modules: its format quantizes, or it is
    ``auto``, which is resolved only after the load (it waits for our CPU operators: worker/service.py)."""
    return weights == AUTO or FORMATS[parse_weights(weights)].quantizes


_auto_logged = False


def auto_choice(device: str = "cpu") -> str:
    """What ``auto`` means on this device and ISA: on a CPU where torch reports AVX2 or AVX-512, w4a8
    where our int8 operator serves (the fastest for one request and for batches on both machines:
    docs/BENCHMARKS.md), else int4 (torch's int4 kernel); else fp32. On CUDA dense weights (fp32 here;
    the autocast decides bf16): the one H200 run measured dense bf16 at 1,240-2,534 GB/s on the 1B
    shapes and the old int4 kernel at 40-61 GB/s (docs/journal/provenance.md). int4 streams 5/16 of
    bf16's bytes, so it wins only above ~0.31x dense's bandwidth (~790 GB/s there) and only once a run
    shows the redesigned kernel within its error bound: until then int4 / int8 must be asked
    for. Logged once per process."""
    global _auto_logged
    cap = torch.backends.cpu.get_cpu_capability()
    choice = fp32.FORMAT.name
    if str(device).startswith("cpu") and cap in ("AVX2", "AVX512"):
        choice = (w4a8.FORMAT if int8_gemv_kernel() is not None else int4.FORMAT).name
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
    if auto_choice(device) == int4.FORMAT.name:
        why = cpu_gemv.unavailable.get("int8_gemv", "unknown")
        return f"auto on {cap}: not w4a8, our CPU operators are unavailable ({why[:300]})"
    return f"auto on {cap}"


def served(weights: str, device: str = "cpu", source: str | None = None) -> str:
    """``--weights`` as asked for a model read from ``source``: ``auto`` becomes ``gguf`` where it would
    serve w4a8 and the GGUF's layers hold a kind other than Q4_1 (w4a8 would round those a second time
    into Q4_1); anything else is returned as asked (``auto`` resolved later, by the device; a source
    that is not a GGUF file here, too: its load says what is wrong with it)."""
    if weights != AUTO or not source or not str(source).endswith(".gguf") or not Path(source).is_file():
        return weights
    if auto_choice(device) != w4a8.FORMAT.name:
        return weights
    return kquant.FORMAT.name if kquant.layer_kinds(str(source)) & set(kquant.KINDS) else weights


def served_why(asked: str, device: str = "cpu", source: str | None = None) -> str:
    """:func:`weights_why`, saying so where auto keeps a GGUF's own block types."""
    why = weights_why(asked, device)
    keeps = asked == AUTO and served(asked, device, source) == kquant.FORMAT.name
    return f"{why}: the GGUF's own block types" if keeps else why


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
        raise ValueError(f"--weights {fmt.name} takes blocks of {fmt.group} inputs only; group {group} was asked")
    stuck = fmt.uncompilable(layout)
    if compile and stuck and not dev.startswith("cuda"):
        raise ValueError(compile_refusal(stuck, fmt.name))
    cfg = WeightConfig(fmt.name, dev, layout, group, switches or current_switches())
    fmt.check_machine(cfg)
    return cfg


def resolve_mode(mode: str, device: str = "cpu") -> str:
    """The format ``--weights mode`` serves on ``device`` (``auto`` resolved), checked as :func:`resolve`."""
    return resolve(mode, device).weights


__all__ = ["AUTO", "FORMATS", "WeightFormat", "auto_choice", "compile_refusal", "may_quantize", "names", "served", "served_why",
           "parse_weights", "register", "resolve", "resolve_mode", "weights_why"]


# The formats, one line each, in the order --weights lists them.
register(fp32.FORMAT)
register(int8.FORMAT)
register(int4.FORMAT)
register(w8a8.FORMAT)
register(w4a8.FORMAT)
register(kquant.FORMAT)
