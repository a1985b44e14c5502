"""``mfs::decode_attention`` (``kernels/cpu_attention.cpp``): one decode query per row against its context
read in place from the paged KV pool, the row's new K/V entry taken from the step (not yet written).
The compiled decode layer (``worker/compiled_step.py``) calls it instead of gathering the context,
putting the new entry in and calling SDPA on the copy. Built with :func:`kernels.cpu_gemv.build`
(the same compiler flags and cache) and loaded once per process; :func:`decode_attention_kernel` is
the operator where it builds (AVX2 or AVX-512 CPUs), else None. ``MFS_CPU_ATTENTION=0`` turns it off.
The choice is logged once per process."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import structlog
import torch

from kernels.cpu_gemv import build, isa

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_loaded: list[bool] = []
_choice: list = []


def load() -> None:
    """Builds (if needed) and loads the operator once per process; registers its shape function."""
    if _loaded:
        return
    torch.ops.load_library(str(build(SOURCE)))

    @torch.library.register_fake("mfs::decode_attention")
    def _(q, k_pool, v_pool, flat, last, k_new, v_new, scale):
        return q.new_empty(q.shape)

    _loaded.append(True)


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
    if not _choice:
        cap = torch.backends.cpu.get_cpu_capability()
        kernel, why = None, None
        if os.environ.get("MFS_CPU_ATTENTION", "1") == "0":
            why = "MFS_CPU_ATTENTION=0"
        elif cap not in ("AVX2", "AVX512"):
            why = f"cpu capability {cap} (the operator needs AVX2)"
        else:
            try:
                load()
                kernel = torch.ops.mfs.decode_attention
            except (RuntimeError, OSError) as e:
                why = f"build failed: {e}"
        log.info("decode attention kernel", kernel=f"mfs::decode_attention ({isa()})" if kernel
                 else "gather + SDPA", cpu_capability=cap, **({"why": why} if why else {}))
        _choice.append(kernel)
    return _choice[0]


__all__ = ["load", "decode_attention_kernel", "decode_attention_reference"]
