"""``mfs::argmax_rows`` (``kernels/cpu_argmax.cpp``): greedy decoding's argmax over each row of a CPU fp32
[M, N] tensor, the same answer as ``torch.argmax(x, dim=-1)`` (the first maximum; a row's first NaN if
it has one) in a tenth of its time at a decode step's head. Built with :func:`kernels.cpu_gemv.build`
(the same compiler flags and cache) and loaded once per process; :func:`argmax_kernel` is the operator
where it builds (AVX2 or AVX-512 CPUs), else None. ``MFS_CPU_ARGMAX=0`` turns it off. The choice is
logged once per process."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kernels.cpu_gemv import load_once, pick_operator

SOURCE = Path(__file__).with_name("cpu_argmax.cpp")
_loaded: list[bool] = []
_choice: list = []


def load() -> None:
    """Builds (if needed) and loads the operator once per process; registers its shape function."""
    def register() -> None:
        @torch.library.register_fake("mfs::argmax_rows")
        def _(x):
            return x.new_empty(x.shape[:1], dtype=torch.long)

    load_once(_loaded, SOURCE, register)


def argmax_kernel() -> Callable | None:
    """``torch.ops.mfs.argmax_rows`` on a CPU where torch reports AVX2 or AVX-512 and it builds, else
    None (``torch.argmax``); decided and logged once per process."""
    return pick_operator(_choice, "MFS_CPU_ARGMAX", load, "argmax_rows", "greedy argmax kernel", "torch.argmax")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a 2-D ``x``: through the operator where ``x`` is a CPU fp32 tensor
    with contiguous rows and the operator builds, else torch's."""
    op = argmax_kernel() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 \
        and x.shape[1] > 0 and x.stride(1) == 1 else None
    return op(x) if op is not None else torch.argmax(x, dim=-1)


__all__ = ["argmax_kernel", "argmax_rows", "load"]
