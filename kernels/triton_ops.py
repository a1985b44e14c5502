"""The ``triton`` kernel backend: the Triton version of every hot-path op, as one :class:`KernelOps`.

:mod:`kernels.ops` imports this lazily and falls back to the torch ops on ``ImportError``, which is
what :func:`build` raises when triton is missing or when its kernels could not run here (no CUDA
and no interpreter). :func:`use_interpreter` puts the kernels in triton's CPU interpreter.
"""
from __future__ import annotations

import functools

import os
import sys
from dataclasses import replace

from kernels.kernel_ops import KernelOps


def use_interpreter() -> None:
    """Run the kernels in triton's CPU interpreter (tests, the CPU bench). Triton decides interpreter
    or GPU when a function is decorated, its own library's included, so this must come before the
    process first imports triton; afterwards it can only say so."""
    os.environ["TRITON_INTERPRET"] = "1"
    lang = sys.modules.get("triton.language")
    if lang is not None and type(lang.sum).__name__ == "JITFunction":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                           "are compiled for a GPU; set TRITON_INTERPRET=1 in the environment (or "
                           "in tests/conftest.py) before anything imports triton")


def _require_runnable(kernel) -> None:
    import torch  # noqa: PLC0415

    from kernels.common_triton import interpreted  # noqa: PLC0415
    if not (torch.cuda.is_available() or interpreted(kernel)):
        raise ImportError("triton kernels need CUDA, or TRITON_INTERPRET=1 set before they are "
                          "imported (CPU interpreter, for tests)")


def build(torch_ops: KernelOps) -> KernelOps:
    """torch_ops with each op replaced by its Triton version, named "triton"."""
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError as e:
        raise ImportError(f"the triton package is not importable: {e}") from e
    from kernels.kv_write_triton import write_kv_triton  # noqa: PLC0415
    from kernels.paged_attention_triton import (_paged_attention_kernel,  # noqa: PLC0415
                                                paged_attention_triton)
    from kernels.rmsnorm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: PLC0415
    from kernels.rotary_triton import rotary_triton  # noqa: PLC0415

    _require_runnable(_paged_attention_kernel)
    return replace(torch_ops, name="triton", rms_norm=rms_norm_triton,
                   fused_add_rms_norm=fused_add_rms_norm_triton, rotary=_without_memo(rotary_triton),
                   write_kv=write_kv_triton, paged_attention=_without_memo(paged_attention_triton))


def _without_memo(kernel):
    """The torch ops take a per-step ``memo`` of index tensors to reuse across layers; the Triton
    kernels compute their indices on the device inside each launch and have nothing to reuse."""
    @functools.wraps(kernel)
    def call(*args, memo=None, **kw):
        return kernel(*args, **kw)
    return call
