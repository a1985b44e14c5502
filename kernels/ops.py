"""The kernel backend of a worker: which implementation of each hot-path op the model calls.

``torch`` is the CPU path: on fp32 CPU tensors each op is our per-row operator
(:mod:`kernels.cpu_rows`: a row's values depend on that row only, on the eager and the compiled path
alike), elsewhere the torch reference beside it. ``triton`` (CUDA, or the CPU interpreter under
``TRITON_INTERPRET=1`` for tests) is filled in by the Triton kernels beside each reference; any op
without a Triton version falls back to its reference. Choose with :func:`select_backend`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import structlog

import torch.nn.functional as F

from kernels import cpu_rows
from kernels.kv_write import write_kv_torch

log = structlog.get_logger(__name__)


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


def _triton_ops() -> KernelOps:
    # Imported lazily: triton is optional at run time on a CPU-only host.
    from kernels import triton_ops  # noqa: PLC0415
    return triton_ops.build(TORCH_OPS)


def select_backend(requested: str | None = None, device: str = "cpu") -> KernelOps:
    """'auto' (default, or $MFS_KERNELS): Triton on CUDA, torch elsewhere. 'torch' / 'triton' force."""
    choice = (requested or os.environ.get("MFS_KERNELS") or "auto").lower()
    if choice not in {"auto", "torch", "triton"}:
        raise ValueError(f"unknown kernel backend {choice!r}: expected auto, torch or triton")
    if choice == "auto":
        choice = "triton" if str(device).startswith("cuda") else "torch"
    ops = TORCH_OPS
    if choice == "triton":
        try:
            ops = _triton_ops()
        except ImportError as e:  # no Triton kernels or no triton package: say so, keep serving
            log.warning("triton kernels unavailable, using torch", error=str(e))
    log.info("kernel backend selected", backend=ops.name, device=str(device))
    return ops
