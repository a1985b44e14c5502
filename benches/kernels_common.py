"""What `mfs bench kernels`' parts share (benches/kernels.py, kernels_quant.py, kernels_step.py): the
shapes, the bandwidth the floors assume, and the CUDA timer."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Dims:
    """The attention and norm shapes of one pass."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


SERVE = Dims(hidden=2048, heads=32, kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16)
TINY = Dims(hidden=48, heads=6, kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16)
# ~1B Llama: 16 layers of 2048 wide, 32 heads over 8 KV heads, MLP 8192, vocab 32000.
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                intermediate_size=8192, vocab_size=32000)
# The default family's base, SmolLM2-135M (its config.json / the GGUF's metadata): 30 layers of 576,
# 9 heads over 3 KV heads, MLP 1536, vocab 49152, the head tied to the embedding, rope theta 1e5.
SMOLLM2_135M = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152)
SHAPES = {"1b": (LLAMA_1B, False, 500000.0), "smollm2-135m": (SMOLLM2_135M, True, 100000.0)}
H200_BANDWIDTH = 4.8e12
EPS = 1e-5


def randn(*shape, dims: Dims, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dims.dtype)


class Timer:
    """Median milliseconds of single calls between CUDA events, L2 flushed before each call."""

    def __init__(self, iters: int):
        self.iters = iters
        self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > H200's L2

    def __call__(self, fn) -> float:
        for _ in range(3):  # compile and warm up
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
