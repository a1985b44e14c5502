"""`mfs bench peers`' spec, which every contender's child reads, and the measurements the children share:
resident memory and perplexity over the held-out windows."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Spec:
    model: str
    threads: int
    prompts: list[list[int]]      # prompts[0] is the single request; all of them run concurrently
    mix: list[int]                # tier of each concurrent request in the family-mix run
    new_tokens: int
    windows: list[list[int]]      # held-out perplexity windows
    gguf: str | None
    device: str = "cpu"           # MFS and transformers run here; llama.cpp (a CPU build) always on CPU
    long_prompt: list[int] = field(default_factory=list)  # one request's time to first token; [] = not run
    up_args: list[str] = field(default_factory=list)      # the api contender's extra `mfs up` flags
    llama_cpp_sequential: bool = True  # llama.cpp's "concurrent" run: the requests one after another


# ---- measurements, run inside a child ------------------------------------------------------------
def rss(device: str = "cpu") -> dict:
    """Resident host memory, and on CUDA the device memory torch holds (now and at peak)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5].lower()] = int(line.split()[1]) * 1024
    res = {"rss_bytes": out.get("vmrss", 0), "peak_rss_bytes": out.get("vmhwm", 0)}
    if device.startswith("cuda"):
        res.update(cuda_bytes=torch.cuda.memory_allocated(), peak_cuda_bytes=torch.cuda.max_memory_allocated())
    return res


@torch.inference_mode()
def perplexity(logits_fn, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w])
        logits = logits_fn(ids)[0, :-1].float().cpu()
        nll += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += len(w) - 1
    return float(torch.exp(torch.tensor(nll / count)))
