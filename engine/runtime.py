"""What the machine offers, decided at run time: bf16 autocast only where the CPU computes bf16
natively (on AVX2 a bf16 matmul is ~50x slower than fp32), and progress bars that stay quiet when
stderr is not a terminal."""
from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import torch


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def autocast_dtype(choice: str, device: str = "cpu") -> torch.dtype | None:
    """'auto': bf16 on CUDA and on CPUs with AVX512-BF16/AMX, else None (fp32). 'bf16' forces it,
    'none' disables it."""
    if choice == "none":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if choice != "auto":
        raise ValueError(f"unknown autocast {choice!r}: auto, bf16 or none")
    if str(device).startswith("cuda") or cpu_has_native_bf16():
        return torch.bfloat16
    return None


def progress(**kw):
    """tqdm that draws only on a terminal (disable=None) and at most once a second."""
    from tqdm import tqdm  # noqa: PLC0415
    kw.setdefault("mininterval", 1.0)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(disable=None if sys.stderr.isatty() else True, **kw)


def save_figure(fig, path, dpi: int = 100) -> None:
    """Lays out, writes (creating the folder) and closes a matplotlib figure."""
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json(path, obj, indent: int = 2) -> None:
    """A benchmark's or evaluation's JSON result, its folder created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=indent) + "\n")
