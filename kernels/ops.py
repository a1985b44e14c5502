"""The kernel backend of a worker: which table of hot-path ops (:mod:`kernels.kernel_ops`) the model
calls. ``torch`` is the CPU table; ``triton`` (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``
for tests) is filled in by the Triton kernels beside each reference; any op without a Triton version falls
back to its reference. Choose with :func:`select_backend`.
"""
from __future__ import annotations

import structlog

from kernels import switches
from kernels.kernel_ops import TORCH_OPS, KernelOps

log = structlog.get_logger(__name__)


def _triton_ops() -> KernelOps:
    # Imported lazily: triton is optional at run time on a CPU-only host.
    from kernels import triton_ops  # noqa: PLC0415
    return triton_ops.build(TORCH_OPS)


def select_backend(requested: str | None = None, device: str = "cpu") -> KernelOps:
    """'auto' (default, or ``MFS_KERNELS``: kernels/switches.py): Triton on CUDA, torch elsewhere.
    'torch' / 'triton' force."""
    if requested is not None and requested not in switches.KERNELS:
        raise ValueError(f"unknown kernel backend {requested!r}: expected {', '.join(switches.KERNELS)}")
    choice = requested or switches.current().kernels
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


__all__ = ["TORCH_OPS", "KernelOps", "select_backend"]
