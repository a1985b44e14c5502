"""kernels.paged_attention.decode_gather eagerly, as the compiled decode path called it before each graph call
until the context slots moved into the graph: 6 decode rows of 20-60 positions over scattered 16-slot blocks,
median µs a call over 2000 calls. usage: python tools/probes/gather_cost.py"""
import statistics
import time

import torch

from kernels.paged_attention import decode_gather


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([20, 35, 41, 47, 52, 60])
    tables = torch.randperm(2048, generator=g)[:24].view(6, 4)
    rows, host = list(range(6)), lens.tolist()
    with torch.inference_mode():
        ts = []
        for _ in range(2000):
            t = time.perf_counter()
            decode_gather(tables, lens, rows, rows, host, 16, {})
            _ = lens - 1  # the `last` positions it computed alongside
            ts.append(time.perf_counter() - t)
    print(f"decode_gather, 6 rows: {statistics.median(ts[100:]) * 1e6:.1f} us a call")


if __name__ == "__main__":
    main()
