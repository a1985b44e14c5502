"""``mfs::decode_attention`` (``kernels/cpu_attention.cpp``): one decode query per row against its context
read in place from the paged KV pool, the row's new K/V entry taken from the step (not yet written).
The compiled decode layer (``worker/compiled_step.py``) calls it instead of gathering the context,
putting the new entry in and calling SDPA on the copy. Built with :func:`kernels.cpu_gemv.build`
(the same compiler flags and cache) and loaded once per process; :func:`decode_attention_kernel` is
the operator where it builds (AVX2 or AVX-512 CPUs), else None. ``MFS_CPU_ATTENTION=0`` turns it off.
The choice is logged once per process."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kernels.cpu_gemv import load_once, pick_operator

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_loaded: list[bool] = []
_choice: list = []


def load() -> None:
    """Builds (if needed) and loads the operator once per process; registers its shape function."""
    def register() -> None:
        @torch.library.register_fake("mfs::decode_attention")
        def _(q, k_pool, v_pool, flat, last, k_new, v_new, scale):
            return q.new_empty(q.shape)

    load_once(_loaded, SOURCE, register)


def decode_attention_reference(q, k_pool, v_pool, flat, last, k_new, v_new, scale: float) -> torch.Tensor:
    """``mfs::decode_attention`` in float64, one row at a time (tests)."""
    T, Hq, D = q.shape
    G = Hq // k_pool.shape[1]
    lmax = flat.numel() // max(T, 1)
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for t in range(T):
        n = int(last[t]) + 1
        slots = flat[t * lmax:t * lmax + n - 1]
        k = torch.cat([k_pool[slots], k_new[t:t + 1]]).double().repeat_interleave(G, dim=1)  # [n, Hq, D]
        v = torch.cat([v_pool[slots], v_new[t:t + 1]]).double().repeat_interleave(G, dim=1)
        w = torch.softmax(torch.einsum("hd,phd->hp", q[t].double(), k) * scale, dim=-1)
        out[t] = torch.einsum("hp,phd->hd", w, v)
    return out.float()


def decode_attention_kernel() -> Callable | None:
    """``torch.ops.mfs.decode_attention`` on a CPU where torch reports AVX2 or AVX-512 and it builds,
    else None (the gather + SDPA path); decided and logged once per process."""
    return pick_operator(_choice, "MFS_CPU_ATTENTION", load, "decode_attention", "decode attention kernel",
                         "gather + SDPA")


__all__ = ["load", "decode_attention_kernel", "decode_attention_reference"]
