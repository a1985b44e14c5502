"""Where a family's base weights are, as users have them (a Hugging Face directory or a GGUF file), and
where their caches go (the GGUF's dequantized copy, a HF directory's complete config): data only, no
torch, no transformers. :func:`locate` answers all of it once; family/loader.py reads the weights from
there, and family/tokenizer.py the tokenizer. Nothing here reaches a model hub: paths must exist locally."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def split_source(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a HF directory, a .gguf file, or a dir holding one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist (MFS never downloads models)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p}: expected a Hugging Face directory or a .gguf file")
        return p.parent, p.name
    if (p / "config.json").exists():
        return p, None
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0]
    raise ValueError(f"{p}: no config.json and {'several' if ggufs else 'no'} .gguf files found")


def cache_root() -> Path:
    return Path(os.environ.get("MFS_CACHE", Path.home() / ".cache" / "mfs"))


def file_key(path: Path) -> str:
    """A cache key for a file as it is now: its resolved path, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_cache_dir(folder: Path, gguf: str) -> Path:
    """Where a GGUF's dequantized copy is kept, named by the file's content (sha256), so every copy of
    the same GGUF (another virtualenv, another clone) shares one cache; the content hash is computed
    once per path, size and time and remembered."""
    path = folder / gguf
    memo = cache_root() / "gguf" / "by-path" / file_key(path)
    try:
        key = memo.read_text().strip()
    except OSError:
        key = ""
    if not re.fullmatch(r"[0-9a-f]{16}", key):  # none yet (or, before writes were atomic, one read half-written)
        with open(path, "rb") as f:
            key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(key)
            os.replace(tmp, memo)  # atomic: a process starting beside this one reads the key or nothing
        except OSError:  # a read-only (or full) cache only costs the next load a hash
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return cache_root() / "gguf" / key


@dataclass(frozen=True, slots=True)
class BaseSource:
    """A base model's weights as the user named them, and what to read: ``folder`` (with ``gguf`` the
    GGUF file to dequantize, None for a HF directory) -- the GGUF's dequantized cache once complete."""
    original: str  # the user's folder / file
    folder: Path
    gguf: str | None
    cache_dir: Path | None  # where the GGUF's dequantized copy is (or goes); None: the user gave a HF directory
    config_cache: Path | None  # where a HF directory's complete config is kept; None: a GGUF or its cache

    @property
    def cached(self) -> bool:
        """Whether ``folder`` is the GGUF's dequantized cache (its config.json is transformers' complete one)."""
        return self.cache_dir is not None and self.gguf is None


def locate(path: str | os.PathLike) -> BaseSource:
    """Where ``path``'s weights are read from and their caches written (FileNotFoundError / ValueError:
    not a HF directory or a GGUF)."""
    folder, gguf = split_source(path)
    original = str(folder / (gguf or ""))
    if gguf is None:
        config_cache = cache_root() / "config" / f"{file_key(folder / 'config.json')}.json"
        return BaseSource(original, folder, None, None, config_cache)
    cache = gguf_cache_dir(folder, gguf)
    if (cache / ".complete").exists():
        return BaseSource(original, cache, None, cache, None)
    return BaseSource(original, folder, gguf, cache, None)


def resolve_cached(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(directory, gguf file or None) to load from: a GGUF's dequantized cache once it is complete."""
    src = locate(path)
    return src.folder, src.gguf
