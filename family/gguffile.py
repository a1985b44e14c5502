"""The tensor index of a GGUF file (name, block kind, shape, bytes), read in milliseconds: the header's
key/value metadata is stepped over (a tokenizer's 100k strings are skipped by their lengths) instead of
parsed field by field as gguf-py's ``GGUFReader`` does (~9 CPU-seconds for the default SmolLM2 GGUF on a
2-vCPU EPYC). Torch-free; the data is a read-only numpy memmap of the file.

Layout (GGUF v2/v3, little-endian): ``GGUF``, version u32, tensor count u64, key/value count u64; each
key/value: a string key, a value type u32 and its value (arrays: element type u32, count u64, elements);
then per tensor: name, dimension count u32, dimensions u64 (innermost first), type u32, offset u64; the
data starts at the next multiple of ``general.alignment`` (32 when absent), offsets relative to it.
A tensor's :attr:`GGUFEntry.data` has gguf-py's shape: dimensions outermost first, the innermost in bytes
for block types (rows of whole blocks)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# value type -> struct format of a scalar (8: string, 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (its message says where and why)."""


@dataclass(frozen=True, slots=True)
class GGUFEntry:
    name: str
    kind: str  # GGML's type name: F32, F16, Q4_1, Q4_K, ...
    dims: tuple[int, ...]  # as the file lists them: innermost first
    offset: int  # absolute, in the file
    nbytes: int
    _mm: np.memmap = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as gguf-py's ``ReaderTensor.data`` shapes them (a view of the memmap)."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        outer = tuple(reversed(self.dims[1:]))
        if block == 1 and self.kind in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
            dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8,
                     "I16": np.int16, "I32": np.int32, "I64": np.int64}[self.kind]
            return self._mm[self.offset:self.offset + self.nbytes].view(dtype).reshape(*outer, self.dims[0])
        return self._mm[self.offset:self.offset + self.nbytes].reshape(*outer, self.dims[0] // block * size)


class GGUFFile:
    """``GGUFFile(path).tensors``: the file's tensors in the file's order; ``.alignment``, ``.version``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self.tensors = self._read()
        except (struct.error, IndexError, KeyError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"{self.path}: not a readable GGUF at byte {self._pos}: {e!r}") from e

    @cached_property
    def by_name(self) -> dict[str, GGUFEntry]:
        return {t.name: t for t in self.tensors}

    def _take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def _string(self) -> bytes:
        n = self._take("Q")
        s = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        return s

    def _skip_value(self, vtype: int) -> object:
        """Steps over one value; returns it where it is a scalar (the alignment is one)."""
        if vtype in _SCALARS:
            return self._take(_SCALARS[vtype])
        if vtype == _STRING:
            n = self._take("Q")
            self._pos += n
            return None
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown value type {vtype} at byte {self._pos}")
        etype, count = self._take("I"), self._take("Q")
        if etype in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[etype])
        elif etype == _STRING:
            buf, pos = self._buf, self._pos
            for _ in range(count):
                pos += 8 + int.from_bytes(buf[pos:pos + 8], "little")
            self._pos = pos
        else:
            for _ in range(count):
                self._skip_value(etype)
        return None

    def _read(self) -> list[GGUFEntry]:
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self._pos = 4
        self.version = self._take("I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} (this reader knows 2 and 3)")
        n_tensors, n_kv = self._take("Q"), self._take("Q")
        self.alignment = 32
        for _ in range(n_kv):
            key = self._string()
            value = self._skip_value(self._take("I"))
            if key == b"general.alignment":
                self.alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            name = self._string().decode()
            dims = tuple(self._take("Q") for _ in range(self._take("I")))
            infos.append((name, GGMLQuantizationType(self._take("I")).name, dims, self._take("Q")))
        start = -(-self._pos // self.alignment) * self.alignment
        out = []
        for name, kind, dims, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            count = int(np.prod(dims, dtype=np.int64))
            nbytes = count // block * size
            if start + offset + nbytes > len(self._mm):
                raise GGUFFormatError(f"{self.path}: tensor {name} ends past the end of the file")
            out.append(GGUFEntry(name, kind, dims, start + offset, nbytes, self._mm))
        return out


__all__ = ["GGUFEntry", "GGUFFile", "GGUFFormatError"]
