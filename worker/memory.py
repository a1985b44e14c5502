"""Giving a worker's freed heap back to the system: glibc keeps the pages of freed allocations below its
mmap threshold (a load's and a long step's transients: hundreds of MB) in its arenas, resident, until
``malloc_trim`` returns them. A no-op where the C library has no ``malloc_trim`` (not glibc)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc

_trim: list = []  # [the C function, or None where there is none], looked up once


def release_memory(collect: bool = True) -> None:
    """Frees what Python still holds unreachable (``collect``), then returns the free heap pages."""
    if collect:
        gc.collect()
    if not _trim:
        try:
            _trim.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _trim.append(None)
    if _trim[0] is not None:
        _trim[0](0)


__all__ = ["release_memory"]
