"""mfs::decode_attention as a decode step meets it: 30 layers' pools in turn, each call after 2.2 MB of
"weights" streamed through the caches (a layer's w4a8 linears), each row's context in blocks of 16 slots,
R rows at P positions; median per call over rounds, and the GB/s of the K/V bytes it reads.
usage: python tools/probes/attn_cold.py SOURCE.cpp [POSITIONS [THREADS [cold|hot [small|huge]]]]
(hot: no weights streamed between the calls; huge: the pools in one mapping advised for 2 MB pages)"""
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels.cpu_gemv import build


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    torch.ops.load_library(str(build(Path(sys.argv[1]))))
    op = torch.ops.mfs.decode_attention
    P = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    STREAM = len(sys.argv) <= 4 or sys.argv[4] != "hot"
    LAYERS, BLOCKS, BS, Hkv, D, Hq = 30, 128, 16, 3, 64, 9
    weights = torch.randn(LAYERS, 2_200_000 // 4)
    HUGE = len(sys.argv) > 5 and sys.argv[5] == "huge"
    if HUGE:  # every pool in one mapping the kernel may back with 2 MB pages
        import mmap
        nbytes = LAYERS * 2 * BLOCKS * BS * Hkv * D * 4
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        big = torch.frombuffer(buf, dtype=torch.float32).view(LAYERS, 2, BLOCKS * BS, Hkv, D)
        big.normal_()
        pools = [(big[i, 0], big[i, 1]) for i in range(LAYERS)]
    else:
        pools = [(torch.randn(BLOCKS * BS, Hkv, D), torch.randn(BLOCKS * BS, Hkv, D)) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(0)
    for R in (1, 2, 4, 8):
        nb = -(-P // BS)
        blocks = torch.randperm(BLOCKS, generator=g)[:R * nb].view(R, nb)  # each row its own blocks
        flat = (blocks[:, :, None] * BS + torch.arange(BS)).reshape(R, -1)[:, :P].reshape(-1).contiguous()
        last = torch.full((R,), P - 1)
        q, k, v = torch.randn(R, Hq, D), torch.randn(R, Hkv, D), torch.randn(R, Hkv, D)
        per = []
        for rnd in range(40):
            tot = 0.0
            for layer, (kp, vp) in enumerate(pools):
                if STREAM:
                    weights[layer].sum()
                t = time.perf_counter()
                op(q, kp, vp, flat, last, k, v, 0.125)
                tot += time.perf_counter() - t
            per.append(tot / LAYERS)
        med = statistics.median(per[5:])
        gbs = R * (P - 1) * Hkv * D * 4 * 2 / med / 1e9
        print(f"{Path(sys.argv[1]).name} rows {R} positions {P}: {med * 1e6:.1f} us a call, {gbs:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
