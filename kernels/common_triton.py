"""What every Triton wrapper shares: the argument checks and where a kernel may run.

A Triton kernel runs on CUDA tensors, or on CPU tensors when it was decorated under the interpreter
(``TRITON_INTERPRET=1`` set before the kernel modules are imported). The interpreter computes on
numpy, which has no bfloat16: arithmetic on bf16 values there is wrong, so kernels upcast every load
to fp32 before computing (which is also what they do on a GPU), and its fp32 -> bf16 cast truncates,
so kernels round through :func:`round_to`. The checks raise ``ValueError``
with the argument's name so a bad call fails at the wrapper, never inside a kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreted(kernel) -> bool:
    """True when ``kernel`` runs in triton's CPU interpreter. Triton decides this when the kernel is
    decorated (module import), so the kernel object, not today's environment, is the authority."""
    return type(kernel).__name__ == "InterpretedFunction"


def require(ok: bool, message: str, *args) -> None:
    """Raise ValueError(message.format(*args)) unless ok. The message is formatted only on failure:
    these checks run on every call of the hot path."""
    if not ok:
        raise ValueError(message.format(*(tuple(a) if isinstance(a, torch.Size) else a for a in args)))


def check_float(name: str, t: torch.Tensor) -> None:
    require(t.dtype in FLOAT_DTYPES, "{} must be float32, bfloat16 or float16, got {}", name, t.dtype)


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    require(t.dtype in INDEX_DTYPES, "{} must be int32 or int64, got {}", name, t.dtype)
    require(t.dim() == dim, "{} must have {} dims, got shape {}", name, dim, t.shape)
    require(t.numel() == 0 or t.stride(-1) == 1, "{} must be contiguous in its last dim", name)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels index the last dim with unit stride; any other dim may be strided.
    require(t.shape[-1] <= 1 or t.stride(-1) == 1,
            "{} must have a unit stride in its last dim, got strides {}", name, t.stride())


def check_device(kernel, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device, and one ``kernel`` can run on. Returns that device."""
    dev = None
    for t in tensors.values():
        if t is None:
            continue
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError("tensors are on different devices: " + ", ".join(
                f"{k}={t.device}" for k, t in tensors.items() if t is not None))
    if dev is not None and dev.type != "cuda":
        require(interpreted(kernel), "triton kernels need CUDA tensors (got {}); on CPU set "
                "TRITON_INTERPRET=1 before importing the kernels, or use the torch ops", dev)
    return dev


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """The kernels are forward-only: a call that must record gradients goes to the reference."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x cast to dtype, rounding to nearest even. A GPU's cast already does; the interpreter's
    bf16 cast truncates, so bf16 is rounded here by hand (NaN and inf come through)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
