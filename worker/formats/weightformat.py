"""What a weight format declares: :class:`WeightFormat` (its name, help, devices, layouts of schemes and
what it needs) and :class:`Layout`. Each format's module declares its own (``FORMAT``); the registry
(worker/formats/registry.py) lists them by ``--weights`` name, and callers ask the format
(``fmt.quantizes``, ``fmt.needs_cpu_operators``), never its name.

A :class:`WeightFormat` says, per layout ("cpu": torch's and our CPU packs; "groups": the Triton
kernel's), which schemes (worker/formats/scheme.py) hold a model's linears, its LM head and its
embedding, each list tried in order (the first whose ``supports`` holds takes the module); on which
devices it runs; what it needs there; and what it does to the model before packing (w8a8 smooths)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from kernels.cpu_gemv import load as load_cpu_gemv
from worker.formats.scheme import Scheme, WeightConfig

TWO_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class Layout:
    """The schemes of one layout, each list tried in order (an empty list: those modules stay as loaded)."""
    linear: tuple[type[Scheme], ...]
    head: tuple[type[Scheme], ...]
    embedding: tuple[type[Scheme], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class WeightFormat:
    """One ``--weights`` format, declared by its module as ``FORMAT`` (see the module docstring)."""
    name: str
    help: str
    devices: tuple[str, ...] = ()  # device types it serves; () any (fp32)
    device_note: str = "quantized kernels exist for CPU and CUDA"  # said when the device is not one of them
    layouts: dict[str, Layout] = field(default_factory=dict)  # {}: nothing is swapped (fp32)
    group: int | None = None  # the only group it takes (w4a8: Q4_1's 32); None: any
    takes_group: bool = False  # its scales go per ``--group`` inputs along K on CPU too (int4)
    needs_cpu_operators: bool = False  # its CPU schemes run only on our operators (kernels/cpu_gemv.py)
    # what else it needs on this machine (gguf: the K-quant operator): raises RuntimeError/OSError saying why
    needs: Callable[[], object] | None = None
    # before packing (w8a8: smoothing): (model, config, load_tokenizer) -> how many linears it changed
    prepare: Callable[[nn.Module, WeightConfig, Callable | None], int] | None = None

    @property
    def quantizes(self) -> bool:
        """Whether it swaps any of a loaded model's modules (fp32 keeps them as loaded)."""
        return bool(self.layouts)

    def schemes(self, layout: str) -> tuple[type[Scheme], ...]:
        """Every scheme of ``layout`` (none where the format has no such layout)."""
        plan = self.layouts.get(layout)
        return () if plan is None else (*plan.linear, *plan.head, *plan.embedding)

    def uncompilable(self, layout: str = "cpu") -> list[str]:
        """The names of its schemes in ``layout`` that an inductor graph cannot hold ([]: it compiles)."""
        return sorted({s.name for s in self.schemes(layout) if not s.compilable})

    def check_machine(self, cfg: WeightConfig) -> None:
        """Raises ValueError saying what this machine lacks for ``cfg`` (our CPU operators, where the
        format needs them and they do not build here)."""
        if not self.needs_cpu_operators:
            return
        try:
            load_cpu_gemv()
            if self.needs is not None:
                self.needs()
        except (RuntimeError, OSError) as e:
            raise ValueError(f"--weights {self.name} needs our CPU operators (kernels/cpu_gemv.py"
                             f"{', ' + self.needs.__module__ if self.needs else ''}), which did not build here: "
                             f"{e}") from e


__all__ = ["Layout", "TWO_DEVICES", "WeightFormat"]
