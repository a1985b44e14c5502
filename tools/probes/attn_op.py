"""mfs::decode_attention at one and more rows, 50-200 positions, two threads, best of 5 x 500 calls.
usage: python tools/probes/attn_op.py SOURCE.cpp (kernels/cpu_attention.cpp)"""
import sys, torch, time
from pathlib import Path
from kernels.cpu_gemv import build


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(2)
    torch.ops.load_library(str(build(Path(sys.argv[1]))))
    op = torch.ops.mfs.decode_attention
    S, Hkv, D, Hq = 2048 * 16, 3, 64, 9
    kp = torch.randn(S, Hkv, D); vp = torch.randn(S, Hkv, D)
    res = []
    for T, L in ((1, 50), (1, 200), (6, 50), (6, 200), (16, 100)):
        q = torch.randn(T, Hq, D); k = torch.randn(T, Hkv, D); v = torch.randn(T, Hkv, D)
        flat = torch.randint(0, S, (T * L,)); last = torch.full((T,), L - 1)
        for _ in range(30): op(q, kp, vp, flat, last, k, v, 0.125)
        best = 1e9
        for r in range(5):
            t = time.perf_counter()
            for _ in range(500): op(q, kp, vp, flat, last, k, v, 0.125)
            best = min(best, (time.perf_counter()-t)/500)
        res.append(f"T{T}L{L}:{best*1e6:.1f}")
    print(Path(sys.argv[1]).name, " ".join(res), "us")


if __name__ == "__main__":
    main()
