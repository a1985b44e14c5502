"""The ``MFS_*`` environment switches of the kernels and the weight formats: the one place that reads
them, once per process (:func:`current`), each checked (ValueError naming the variable and what it takes).

* ``MFS_KERNELS=auto|torch|triton`` -- the op table where ``--kernels`` is not given (kernels/ops.py;
  auto: Triton on CUDA, torch elsewhere);
* ``MFS_CPU_GEMV=0`` -- torch's int8 kernel instead of our ``mfs::int8_gemv`` (kernels/cpu_gemv.py);
* ``MFS_CPU_ATTENTION=0`` -- the compiled decode's gather and SDPA instead of ``mfs::decode_attention``;
* ``MFS_CPU_ARGMAX=0`` -- greedy sampling through ``torch.argmax`` instead of ``mfs::argmax_rows``;
* ``MFS_CPU_ROWS=0`` -- the torch ops instead of the per-row layer operators (kernels/cpu_rows.py);
* ``MFS_CPU_GEMV_ISA=avx2|avx512-vnni`` -- which build of our CPU operators (unset: the CPU's best);
* ``MFS_NONDETERMINISTIC=1`` -- the torch references and SDPA everywhere (``mfs up --nondeterministic``);
* ``MFS_W4A8_TILES=0`` -- w4a8's linears and head keep the row layouts (default: tiles of 16 rows);
* ``MFS_QMM_TUNE=0`` -- the Triton quantized matmul's default tiles, untimed (kernels/quant_matmul_triton.py).

A process reads them when first asked; a child process reads its own environment. A bench that compares
two settings in one process, or a test, sets them with :func:`use`."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# the switches that turn one of our CPU operators off (0; 1 or unset: on where it builds)
OPERATORS = ("MFS_CPU_GEMV", "MFS_CPU_ATTENTION", "MFS_CPU_ARGMAX", "MFS_CPU_ROWS")
KERNELS = ("auto", "torch", "triton")
ISAS = ("avx2", "avx512-vnni")


@dataclass(frozen=True, slots=True)
class Switches:
    kernels: str = "auto"  # MFS_KERNELS
    operators_off: frozenset[str] = frozenset()  # those of OPERATORS set to 0
    cpu_gemv_isa: str = ""  # MFS_CPU_GEMV_ISA; "": the CPU's best
    nondeterministic: bool = False  # MFS_NONDETERMINISTIC=1
    w4a8_tiles: bool = True  # MFS_W4A8_TILES
    qmm_tune: bool = True  # MFS_QMM_TUNE

    def operator_on(self, switch: str) -> bool:
        """Whether the operator that ``switch`` (one of :data:`OPERATORS`) governs may serve."""
        if switch not in OPERATORS:
            raise ValueError(f"{switch!r} is not an operator switch: expected one of {', '.join(OPERATORS)}")
        return switch not in self.operators_off

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Switches":
        """The switches ``env`` sets (ValueError for a value a switch does not take)."""
        def pick(name: str, allowed: tuple[str, ...], default: str) -> str:
            value = env.get(name) or default  # set but empty: unset
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)} (or unset)")
            return value

        return cls(kernels=pick("MFS_KERNELS", KERNELS, "auto"),
                   operators_off=frozenset(n for n in OPERATORS if pick(n, ("0", "1"), "1") == "0"),
                   cpu_gemv_isa=pick("MFS_CPU_GEMV_ISA", ("", *ISAS), ""),
                   nondeterministic=pick("MFS_NONDETERMINISTIC", ("0", "1"), "0") == "1",
                   w4a8_tiles=pick("MFS_W4A8_TILES", ("0", "1"), "1") == "1",
                   qmm_tune=pick("MFS_QMM_TUNE", ("0", "1"), "1") == "1")


_current: list[Switches] = []  # empty until first asked


def current() -> Switches:
    """This process's switches: read from the environment when first asked, then kept."""
    if not _current:
        _current.append(Switches.from_env())
    return _current[0]


def use(switches: Switches | None) -> None:
    """Sets this process's switches (None: read the environment again when next asked). Operators
    already chosen stay chosen (each is decided once per process); what is asked per call
    (``nondeterministic``, ``w4a8_tiles`` for modules built next) follows at once."""
    _current.clear()
    if switches is not None:
        _current.append(switches)


__all__ = ["ISAS", "KERNELS", "OPERATORS", "Switches", "current", "use"]
