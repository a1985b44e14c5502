"""``mfs::gguf_a8_gemv`` (``kernels/cpu_kquant.cpp``): GGUF weight blocks as the file ships them (Q4_0, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) times activations quantized per 32 values to 8 bits, each block's products
summed exactly in integers (the C++ file gives the formula and the order). AVX2; vpdpbusd where the
build has AVX-512 VNNI. Built with :func:`kernels.cpu_gemv.build` (the same compiler flags, ISA choice
and cache) and loaded once per process; :func:`gemv_kernel` is the operator where it builds (AVX2 or
AVX-512 CPUs), else None. A row's output is the same bit for bit at any batch size. Two paths, the same
values: one weight row at a time (``cpu_kquant.cpp``, below 4 activation rows) and tiles of 8 weight rows
decoded once for blocks of activation rows (``cpu_kquant_tile.cpp``, prefill chunks and batches).

:func:`reference` computes the same sum in float64 from the same quantized activations (tests)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kernels.cpu_gemv import load_once, pick_operator, quantize_activations_q8

SOURCE = Path(__file__).with_name("cpu_kquant.cpp")
# the operator's library: the row path and the operator (SOURCE), the tile path (cpu_kquant.h between them)
SOURCES = (SOURCE, SOURCE.with_name("cpu_kquant_tile.cpp"))
# the operator's kind argument: the index here
KINDS = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_1")
_loaded: list[bool] = []
_choice: list = []


def load() -> None:
    """Builds (if needed) and loads the operator once per process; registers its shape function."""
    def register() -> None:
        @torch.library.register_fake("mfs::gguf_a8_gemv")
        def _(x, blocks, kind):
            return x.new_empty(x.shape[0], blocks.shape[0])

    load_once(_loaded, list(SOURCES), register)


def gemv_kernel() -> Callable | None:
    """``torch.ops.mfs.gguf_a8_gemv`` on a CPU where torch reports AVX2 or AVX-512 and it builds, else None
    (and None under ``MFS_CPU_GEMV=0``, as the other matmul operators); decided and logged once per process.
    ``--weights gguf`` loads the operator itself (it has no fallback); tests ask here whether it serves."""
    return pick_operator(_choice, "MFS_CPU_GEMV", load, "gguf_a8_gemv", "GGUF blocks kernel", "none")


def kind_id(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"mfs::gguf_a8_gemv serves {', '.join(KINDS)}; got {kind!r}")
    return KINDS.index(kind)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The operator's value in float64: the dequantized weight (``worker.formats.kquant_blocks.codes``:
    w = scale * q - mins per group, exact in float64) times the activations quantized as the operator
    quantizes them (``dx * xq`` per 32)."""
    xq, dx = quantize_activations_q8(x)
    M, K = x.shape
    xd = (xq.double().view(M, K // 32, 32) * dx.double()[..., None]).view(M, K)
    N = q.shape[0]
    g = K // scale.shape[1]
    w = scale.double().view(N, -1, 1) * q.double().view(N, -1, g)
    if mins is not None:
        w = w - mins.double().view(N, -1, 1)
    return xd @ w.view(N, K).T


__all__ = ["KINDS", "gemv_kernel", "kind_id", "load", "reference"]
