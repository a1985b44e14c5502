"""mfs::int8_a8_gemv at the tied head's shape (49152 x 576), two threads, median of 25, at 1..16 rows.
usage: python tools/probes/a8_head.py SOURCE (kernels/, an older checkout's kernels/, or one .cpp)"""
import sys, time, statistics, torch
from pathlib import Path
from kernels import cpu_gemv


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(2)
    lib = cpu_gemv.build(Path(sys.argv[1])); torch.ops.load_library(str(lib))
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g); s = torch.rand(49152) * 0.01
    op = torch.ops.mfs.int8_a8_gemv
    out = []
    for M in (1, 2, 3, 4, 6, 8, 16):
        x = torch.randn(M, 576, generator=g); ts = []
        for r in range(30):
            t = time.perf_counter(); op(x, q, s); ts.append(time.perf_counter() - t)
        out.append(f"M{M}:{statistics.median(ts[5:])*1e3:.2f}")
    print(Path(sys.argv[1]).name, " ".join(out), "ms")


if __name__ == "__main__":
    main()
