"""The decode-attention operator's test cases, shared by tests/test_cpu_attention.py and the script it
runs in a fresh process under the AVX2 build."""
import torch


def case(T, Hq, Hkv, D, lmax, S=300, seed=0, last=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g)
    kp, vp = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    kn, vn = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    flat = torch.randint(0, S, (T * lmax,), generator=g)
    if last is None:
        last = torch.randint(0, lmax, (T,), generator=g)
        if T:
            last[0] = lmax - 1  # one row with a full context
    return q, kp, vp, flat, last, kn, vn


# (T, Hq, Hkv, D, lmax): SmolLM2-135M's heads (9 over 3, 64), one KV head per query head, four per KV
# head at 128 wide, 32 wide (the AVX2 form on any machine), five per KV head (past the 512-bit form's
# four), one position, and contexts across the exp's 8-lane tail
SHAPES = [(1, 9, 3, 64, 50), (6, 9, 3, 64, 37), (3, 4, 4, 64, 1), (2, 8, 2, 128, 19), (4, 4, 2, 32, 23),
          (2, 10, 2, 64, 9), (5, 9, 3, 64, 200)]
