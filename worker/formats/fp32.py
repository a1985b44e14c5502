"""``--weights fp32``: the weights as loaded (nothing swapped; the autocast decides bf16 on CUDA)."""
from __future__ import annotations

from worker.formats.weightformat import WeightFormat

FORMAT = WeightFormat("fp32", "as loaded")

__all__ = ["FORMAT"]
