"""What a kernel backend is: :class:`KernelOps`, the table of hot-path ops the model calls, and
:data:`TORCH_OPS`, the CPU one: on fp32 CPU tensors each op is our per-row operator
(:mod:`kernels.cpu_rows`: a row's values depend on that row only, on the eager and the compiled path
alike), elsewhere the torch reference beside it. :mod:`kernels.triton_ops` builds the Triton table from it;
:func:`kernels.ops.select_backend` chooses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F

from kernels import cpu_rows
from kernels.kv_write import write_kv_torch


@dataclass(frozen=True, slots=True)
class KernelOps:
    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    write_kv: Callable
    paged_attention: Callable
    silu_mul: Callable = lambda g, u: F.silu(g) * u  # noqa: E731 (the MLP's activation: silu(g) * u)


TORCH_OPS = KernelOps("torch", cpu_rows.rms_norm, cpu_rows.fused_add_rms_norm, cpu_rows.rotary,
                      write_kv_torch, cpu_rows.paged_attention, cpu_rows.silu_mul)
