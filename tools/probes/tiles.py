"""The row layouts' operators against the tiles' (16 weight rows interleaved, a register lane per
output), the same weights, in one process, alternated: mfs::w4a8_gemv vs mfs::w4a8_tile_gemv on (1)
cache-resident weights (N=512, K=1536), one thread, best of 7 x 200 calls, and (2) 30 layers of the
default model's linear shapes streamed from memory, THREADS threads, median of 20 passes; (3)
mfs::int8_a8_gemv vs mfs::int8_a8_tile_gemv at the tied head's shape (49152 x 576), THREADS threads,
median of 25 calls. 1..16 activation rows. MFS_CPU_GEMV_ISA=avx2 times the AVX2 build.
usage: python tools/probes/tiles.py [THREADS=2] [ROUNDS=2]"""
import statistics, sys, time
import torch
from kernels import cpu_gemv


def main() -> None:
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
    hq = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g)
    hs = (torch.rand(49152, generator=g) * 0.02).to(torch.bfloat16)
    head = {"row": (torch.ops.mfs.int8_a8_gemv, hq), "tile": (torch.ops.mfs.int8_a8_tile_gemv, cpu_gemv.tile_int8_rows(hq))}
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
            hd = []
            for M in rows:
                x = torch.randn(M, 576, generator=g)
                op, q = head[form]
                ts = []
                for _ in range(30):
                    t = time.perf_counter()
                    op(x, q, hs)
                    ts.append(time.perf_counter() - t)
                hd.append(f"{M}:{statistics.median(ts[5:]) * 1e3:.2f}")
            print(f"round {rnd} {form:4s} w4a8 hot us  " + " ".join(out))
            print(f"round {rnd} {form:4s} w4a8 30 layers ms  " + " ".join(lay))
            print(f"round {rnd} {form:4s} head ms  " + " ".join(hd), flush=True)


if __name__ == "__main__":
    main()
