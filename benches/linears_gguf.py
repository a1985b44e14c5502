"""`mfs bench linears --gguf`: ``mfs::gguf_a8_gemv`` (``--weights gguf``'s operator, kernels/cpu_kquant.cpp) alone
on a 1B Llama Q4_K_M's linears (hidden 2048, GQA 32/8 heads of 64, MLP 8192, vocab 128256, the tied head
in Q6_K), each shape in the kinds such a file holds it in, at several batch sizes: the median call,
the weight bytes it streams per second (what bounds one row) and its multiply-adds per second (what
bounds many). Random valid blocks: only shapes, kinds and bytes matter for speed. Each shape is held in
enough copies to exceed the CPU's caches, and the calls cycle through them, so a call reads its weight
from memory as a decode step does."""
from __future__ import annotations

import statistics
import time

import torch

from worker.formats.kquant_blocks import BLOCKS

# (name, in, out, kind): the 1B Q4_K_M's distinct linears (q/k/v and gate/up as serving fuses them where
# their kinds agree; v and down are Q6_K in some layers, Q4_K in the others)
LLAMA_1B_Q4_K_M = [("q/o 2048->2048", 2048, 2048, "Q4_K"), ("k/v 2048->512", 2048, 512, "Q4_K"),
                   ("v 2048->512", 2048, 512, "Q6_K"), ("qkv 2048->3072", 2048, 3072, "Q4_K"),
                   ("gate/up 2048->16384", 2048, 16384, "Q4_K"), ("down 8192->2048", 8192, 2048, "Q4_K"),
                   ("down 8192->2048", 8192, 2048, "Q6_K"), ("head 2048->128256", 2048, 128256, "Q6_K")]
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of a super-block's fp16 d (and dmin)
CACHE_BYTES = 64 << 20  # more than this CPU's L2 + L3


def random_blocks(n: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / values * bytes] of random codes and scales, each super-block's fp16 factors set to
    small finite values (random bytes there could be inf or NaN)."""
    values, size = BLOCKS[kind]
    raw = torch.randint(0, 256, (n * (k // values), size), dtype=torch.uint8, generator=gen)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in SCALE_AT[kind]:
        raw[:, at:at + 2] = half
    return raw.view(n, -1)


def measure(shapes=LLAMA_1B_Q4_K_M, batches=(1, 16, 1024), reps: int = 7, max_macs: float = 2e10,
            cache_bytes: int = CACHE_BYTES) -> list[dict]:
    """Per shape and batch: the median of ``reps`` calls (after one warm-up), each on the next of the
    copies that fill ``cache_bytes``, and the fastest (where another job shares the cores, a call whose
    second thread waits for a scheduler slice comes back ~8 ms late); a case of more than ``max_macs``
    multiply-adds (the head at 1024 rows) is left out."""
    from kernels import cpu_kquant  # noqa: PLC0415
    cpu_kquant.load()
    op, gen, rows = torch.ops.mfs.gguf_a8_gemv, torch.Generator().manual_seed(0), []
    for name, k, n, kind in shapes:
        one = random_blocks(n, k, kind, gen)
        copies = [one] + [random_blocks(n, k, kind, gen) for _ in range(-(-cache_bytes // one.numel()) - 1)]
        for m in batches:
            if m * n * k > max_macs:
                continue
            x = torch.randn(m, k, generator=gen)
            times = []
            for r in range(reps + 1):
                w = copies[r % len(copies)]
                t0 = time.perf_counter()
                op(x, w, cpu_kquant.kind_id(kind))
                if r:
                    times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            rows.append({"shape": name, "kind": kind, "in": k, "out": n, "batch": m, "ms": 1e3 * s,
                         "min_ms": 1e3 * min(times), "weight_GBps": one.numel() / s / 1e9, "GMACps": m * n * k / s / 1e9})
            r = rows[-1]
            print(f"{name:<22}{kind:<6}{m:>6}{r['ms']:>11.3f} ms (min {r['min_ms']:.3f})"
                  f"{r['weight_GBps']:>9.2f} GB/s{r['GMACps']:>9.2f} GMAC/s", flush=True)
    return rows


__all__ = ["LLAMA_1B_Q4_K_M", "measure", "random_blocks"]
