"""A decoder layer's per-row work on the CPU: ``mfs::rms_norm``, ``mfs::add_rms_norm``, ``mfs::silu_mul``
and ``mfs::rotary`` (``kernels/cpu_rows.cpp``), and attention for every query of a step through
``mfs::decode_attention`` (``kernels/cpu_attention.cpp``). Built with :func:`kernels.cpu_gemv.build` (the
same compiler flags and cache) and loaded once per process.

Why: a row's values must depend on that row only. torch's eager reductions and SDPA pick their
blocking by the shape of the whole batch (SDPA sums a decode row's context padded to the batch's longest,
a prefill chunk's in the chunk's tiles), and inductor's fused loops round differently from the eager
ops. With these operators the eager layers and the compiled decode graph call the same code, every
query of a step (decode row, verification row, prefill chunk) is attended alone over its own context in
one fixed order, and each norm sums its row in an order fixed by the row's length. So a request's
tokens do not depend on its batch, its prefill chunks, its prefix-cache hits or the path (eager or
compiled) that ran its steps.

Each function below is the operator where it serves (fp32 CPU tensors, no gradient needed, the library
builds on an AVX2 or AVX-512 CPU) and the torch reference otherwise (other dtypes and devices,
training). ``MFS_NONDETERMINISTIC=1`` (``mfs up --nondeterministic``) keeps the torch references and
SDPA everywhere. The choice is logged once per process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import switches
from kernels.cpu_attention import decode_attention_kernel
from kernels.cpu_gemv import load_once, pick_operator
from kernels.paged_attention import gather_index, paged_attention_torch
from kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.rotary import rotary_torch

SOURCE = Path(__file__).with_name("cpu_rows.cpp")
_loaded: list[bool] = []
_choice: list = []


def load() -> None:
    """Builds (if needed) and loads the operators once per process; registers their shape functions."""
    def register() -> None:
        @torch.library.register_fake("mfs::rms_norm")
        def _(x, w, eps):
            return x.new_empty(x.shape)

        @torch.library.register_fake("mfs::add_rms_norm")
        def _(x, residual, w, eps):
            return x.new_empty(x.shape), x.new_empty(x.shape)

        @torch.library.register_fake("mfs::silu_mul")
        def _(g, u):
            return g.new_empty(g.shape)

        @torch.library.register_fake("mfs::rotary")
        def _(q, k, pos, cos_sin):
            return q.new_empty(q.shape), k.new_empty(k.shape)

    load_once(_loaded, SOURCE, register)


def deterministic() -> bool:
    """False where ``MFS_NONDETERMINISTIC=1`` opts out of the per-row operators."""
    return not switches.current().nondeterministic


def rows_kernel() -> bool:
    """Whether the per-row operators serve in this process (built, and not opted out); decided and
    logged once."""
    if not deterministic():
        return False
    return pick_operator(_choice, "MFS_CPU_ROWS", load, "add_rms_norm", "per-row layer operators",
                         "torch ops (batch-dependent rounding)") is not None


def _serves(*ts: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in ts)
            and rows_kernel())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`kernels.rmsnorm.rms_norm_torch`, each row summed alone in a fixed order."""
    if not (_serves(x, weight) and x.shape[-1] and x.stride(-1) == 1):
        return rms_norm_torch(x, weight, eps)
    return torch.ops.mfs.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.rmsnorm.fused_add_rms_norm_torch` on the operators."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if not (_serves(x, residual, weight) and x.shape == residual.shape and x.shape[-1]):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    H = x.shape[-1]
    y, s = torch.ops.mfs.add_rms_norm(x.reshape(-1, H), residual.reshape(-1, H), weight, eps)
    return y.view(x.shape), s.view(x.shape)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u``."""
    if not (_serves(g, u) and g.shape == u.shape and g.dim() == 2 and g.stride(-1) == 1 and u.stride(-1) == 1):
        return F.silu(g) * u
    return torch.ops.mfs.silu_mul(g, u)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.rotary.rotary_torch` (q [T, Hq, D], k [T, Hkv, D]) on the operator."""
    if not (_serves(q, k, cos_sin_cache) and q.stride(-1) == 1 and k.stride(-1) == 1):
        return rotary_torch(q, k, positions, cos_sin_cache, memo)
    return torch.ops.mfs.rotary(q, k, positions, cos_sin_cache)


def attention_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> Callable | None:
    """``mfs::decode_attention`` where it serves this step's q and pool, else None."""
    if not (_serves(q, k_cache) and q.shape[-1] % 16 == 0):
        return None
    return decode_attention_kernel()


def query_context(block_tables: torch.Tensor, q_start_loc: torch.Tensor, ctx_lens: torch.Tensor,
                  q_lens_host: list[int], ctx_lens_host: list[int], block_size: int) -> tuple:
    """Every query token's context as pool slots: (flat [T * lmax], last [T] the token's own position,
    own [T] its own slot). Row r's queries are the last ``q_lens[r]`` of its ``ctx_lens[r]`` positions."""
    dev = block_tables.device
    R = block_tables.shape[0]
    lmax = max(ctx_lens_host)
    q_lens = torch.tensor(q_lens_host, dtype=torch.long, device=dev)
    row = torch.repeat_interleave(torch.arange(R, device=dev), q_lens)  # [T]
    T = row.numel()
    last = ctx_lens.index_select(0, row) - q_lens.index_select(0, row) + (
        torch.arange(T, device=dev) - q_start_loc[:-1].index_select(0, row))
    slots, _ = gather_index(block_tables, ctx_lens, block_size, lmax)  # [R, lmax]
    rows_slots = slots.index_select(0, row)  # [T, lmax]
    own = rows_slots.gather(1, last[:, None])[:, 0]
    return rows_slots.reshape(-1), last, own


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    q_start_loc: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                    q_lens_host: list[int] | None = None, ctx_lens_host: list[int] | None = None,
                    memo: dict | None = None) -> torch.Tensor:
    """:func:`kernels.paged_attention.paged_attention_torch` with every query attended alone over its own
    context by ``mfs::decode_attention`` (the step's K/V already written to the pool): a decode row, a
    verification row and a prefill chunk's token at the same position compute the same bits."""
    op = attention_kernel(q, k_cache)
    if op is None or k_cache.dtype != torch.float32 or q.shape[0] == 0:
        return paged_attention_torch(q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, scale,
                                     q_lens_host, ctx_lens_host, memo)
    nb, bs, hkv, d = k_cache.shape
    ent = memo.get("rows") if memo is not None else None
    if ent is None:
        if q_lens_host is None:
            q_lens_host = (q_start_loc[1:] - q_start_loc[:-1]).tolist()
        if ctx_lens_host is None:
            ctx_lens_host = ctx_lens.tolist()
        ent = query_context(block_tables, q_start_loc, ctx_lens, q_lens_host, ctx_lens_host, bs)
        if memo is not None:
            memo["rows"] = ent
    flat, last, own = ent
    kflat, vflat = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    return op(q.contiguous(), kflat, vflat, flat, last, kflat.index_select(0, own), vflat.index_select(0, own), scale)


__all__ = ["load", "deterministic", "rows_kernel", "rms_norm", "fused_add_rms_norm", "silu_mul", "rotary",
           "attention_kernel", "query_context", "paged_attention"]
