"""SDPA against a plain matmul softmax at one decode query, 9 heads over 3, two threads."""
import torch, time, torch.nn.functional as F


def main() -> None:
    torch.set_num_threads(2)
    for T, L in ((1, 32), (1, 128), (1, 400), (6, 128)):
        q = torch.randn(T, 9, 1, 64); k = torch.randn(T, 3, L, 64); v = torch.randn(T, 3, L, 64)
        mask = torch.zeros(T, 1, 1, L)
        for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)),
                         ("matmul", lambda: torch.softmax((q.view(T, 3, 3, 64) @ k.transpose(-1, -2)) * 0.125 + mask, -1) @ v)):
            for _ in range(50): fn()
            t = time.perf_counter()
            for _ in range(2000): fn()
            print(T, L, name, f"{(time.perf_counter()-t)/2000*1e6:.1f} us")


if __name__ == "__main__":
    main()
