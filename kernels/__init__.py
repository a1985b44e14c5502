"""Hot-path ops of the nested model: torch references (CPU path) and Triton kernels (CUDA path)."""
from kernels.ops import TORCH_OPS, KernelOps, select_backend

__all__ = ["KernelOps", "TORCH_OPS", "select_backend"]
