"""mfs::w4a8_gemv on cache-resident weights (N=512, K=1536), one thread, best of 7 x 200 calls, at
1..16 activation rows. usage: python tools/probes/w4a8_hot.py SOURCE (kernels/, or an older checkout's:
git archive REV kernels | tar -x -C /tmp/old, then /tmp/old/kernels; a single .cpp for a kernel from before
the split). Run each source in its own process."""
import sys, time, torch
from pathlib import Path
from kernels import cpu_gemv


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    lib = cpu_gemv.build(Path(sys.argv[1])); torch.ops.load_library(str(lib))
    g = torch.Generator().manual_seed(0)
    N, K = 512, 1536
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g); dm = (torch.rand(N, K // 32, 2, generator=g) * 0.01).half()
    op = torch.ops.mfs.w4a8_gemv
    out = []
    for M in (1, 2, 4, 6, 8, 16):
        x = torch.randn(M, K, generator=g)
        best = 1e9
        for r in range(7):
            t = time.perf_counter()
            for _ in range(200): op(x, q, dm)
            best = min(best, (time.perf_counter() - t) / 200)
        out.append(f"M{M}:{best*1e6:.1f}us({best*1e9/(N*K*M/1e0)*1e3:.1f}ps/MAC)")
    print(Path(sys.argv[1]).name, " ".join(out))


if __name__ == "__main__":
    main()
