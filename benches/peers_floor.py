"""`mfs bench peers`' memory-bandwidth floor: the machine's streaming-read bandwidth on the bench's
threads, the bytes of a GGUF's weights one decoded token reads, and from both the tokens/s no engine
that reads every weight once a token can beat on one stream; plus the CPU and the load to print beside
every figure."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def bandwidth_gbs(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """GB/s of a streaming read: ``torch.sum`` over a ``mib`` MiB fp32 array (far larger than any cache)
    on ``threads`` torch threads, the best of ``repeats`` after one untimed pass."""
    if threads < 1 or mib < 1 or repeats < 1:
        raise ValueError(f"bandwidth probe: threads {threads}, mib {mib}, repeats {repeats}: each at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        float(a.sum())  # pages touched, code warm
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            float(a.sum())
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return a.numel() * 4 / best / 1e9


def bytes_per_token(gguf_path: str | Path) -> int:
    """Bytes of the GGUF's tensors one decoded token reads: all of them, except the token embedding
    where the file has its own output head (then one embedding row is read, counted as nothing)."""
    from family.gguffile import GGUFFile  # noqa: PLC0415
    tensors = {t.name: t.nbytes for t in GGUFFile(gguf_path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def floor_record(per_token: int | None, bandwidths: list[float]) -> dict | None:
    """The floor's inputs and result for the JSON, from ``per_token`` bytes (:func:`bytes_per_token`)
    and the best of ``bandwidths`` (probes taken before and after the contenders); None without bytes."""
    if per_token is None:
        return None
    gbs = max(bandwidths)
    return {"bandwidth_gbs": gbs, "bandwidth_probes_gbs": bandwidths, "bytes_per_token": per_token,
            "floor_tokens_per_s": gbs * 1e9 / per_token,
            "basis": "torch.sum over a 1 GiB fp32 array on the bench's threads (best of 5 a probe); the GGUF's "
                     "tensors read once a token (the embedding only where it is also the head)"}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load_avg() -> list[float]:
    """``uptime``'s 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]
