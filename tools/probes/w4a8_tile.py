"""mfs::w4a8_gemv (one weight row's blocks across a register) against mfs::w4a8_tile_gemv (16 weight
rows interleaved, a lane per output), the same weights, in one process, alternated: (1) cache-resident
weights (N=512, K=1536), one thread, best of 7 x 200 calls; (2) 30 layers of the default model's linear
shapes streamed from memory, THREADS threads, median of 20 passes. 1..16 activation rows.
usage: python tools/probes/w4a8_tile.py [THREADS=2] [ROUNDS=2]"""
import statistics, sys, time
import torch
from kernels import cpu_gemv

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
cpu_gemv.load()
g = torch.Generator().manual_seed(0)
rows = (1, 2, 4, 6, 8, 16)


def weights(n, k):
    p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    dm = (torch.rand(n, k // 32, 2, generator=g) * 0.01).half()
    return {"row": (torch.ops.mfs.w4a8_gemv, p, dm), "tile": (torch.ops.mfs.w4a8_tile_gemv, *cpu_gemv.tile_q4_rows(p, dm))}


hot = weights(512, 1536)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[weights(n, k) for n, k in shapes] for _ in range(30)]
for rnd in range(rounds):
    for form in ("row", "tile"):
        torch.set_num_threads(1)
        out = []
        for M in rows:
            x = torch.randn(M, 1536, generator=g)
            op, q, dm = hot[form]
            best = 1e9
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(200):
                    op(x, q, dm)
                best = min(best, (time.perf_counter() - t) / 200)
            out.append(f"{M}:{best * 1e6:.1f}")
        torch.set_num_threads(threads)
        lay = []
        for M in rows:
            xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
            ts = []
            for _ in range(25):
                t = time.perf_counter()
                for L in layers:
                    for w, (n, k) in zip(L, shapes):
                        op, q, dm = w[form]
                        op(xs[k], q, dm)
                ts.append(time.perf_counter() - t)
            lay.append(f"{M}:{statistics.median(ts[5:]) * 1e3:.2f}")
        print(f"round {rnd} {form:4s} hot us  " + " ".join(out))
        print(f"round {rnd} {form:4s} 30 layers ms  " + " ".join(lay), flush=True)
