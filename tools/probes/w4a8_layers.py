"""mfs::w4a8_gemv over 30 layers of the default model's linear shapes streamed from memory, median of
20, at 1..16 rows. usage: python tools/probes/w4a8_layers.py SOURCE (kernels/, an older checkout's kernels/, or one .cpp) [THREADS=2]"""
import sys, time, statistics, torch
from pathlib import Path
from kernels import cpu_gemv


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    lib = cpu_gemv.build(Path(sys.argv[1])); torch.ops.load_library(str(lib))
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    g = torch.Generator().manual_seed(0)
    layers = [[(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                (torch.rand(n, k // 32, 2, generator=g) * 0.01).half()) for n, k in shapes] for _ in range(30)]
    op = torch.ops.mfs.w4a8_gemv
    res = {}
    for M in (1, 2, 4, 6, 8, 16):
        xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
        ts = []
        for r in range(25):
            t = time.perf_counter()
            for L in layers:
                for (q, dm), (n, k) in zip(L, shapes):
                    op(xs[k], q, dm)
            ts.append(time.perf_counter() - t)
        res[M] = statistics.median(ts[5:]) * 1e3
    print(sys.argv[1], " ".join(f"M{M}:{v:.2f}ms" for M, v in res.items()))


if __name__ == "__main__":
    main()
