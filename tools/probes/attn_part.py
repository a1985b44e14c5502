"""The compiled layer's old attention path, eager: the context gathered out of the pool, the new entry
put in, SDPA on the copy (two threads; SmolLM2-135M's heads). Compare with attn_op.py."""
import time

import torch
import torch.nn.functional as F


def main() -> None:
    torch.set_num_threads(2)
    S, Hkv, D, Hq = 2048 * 16, 3, 64, 9
    kp, vp = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)


    def part(q, k, v, flat, last, mask, T):
        rows = torch.arange(T)
        kk = kp.index_select(0, flat).view(T, -1, Hkv, D).index_put((rows, last), k)
        vv = vp.index_select(0, flat).view(T, -1, Hkv, D).index_put((rows, last), v)
        return F.scaled_dot_product_attention(q.unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask,
                                              scale=0.125, enable_gqa=True)


    for T, L in ((1, 50), (1, 200), (6, 50), (6, 200)):
        q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
        flat, last, mask = torch.randint(0, S, (T * L,)), torch.full((T,), L - 1), torch.zeros(T, 1, 1, L)
        for _ in range(30):
            part(q, k, v, flat, last, mask, T)
        t = time.perf_counter()
        for _ in range(1000):
            part(q, k, v, flat, last, mask, T)
        print(T, L, "gather + SDPA", f"{(time.perf_counter() - t) / 1000 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
