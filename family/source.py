"""Where a family's base weights are, as users have them (a Hugging Face directory or a GGUF file, and
the GGUF's dequantized cache), and its tokenizer. Nothing here reaches a model hub: paths must exist
locally. transformers is imported only when a tokenizer or config is read."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

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
        with open(path, "rb") as f:
            key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(key)
        except OSError:  # a read-only cache only costs the next load a hash
            pass
    return cache_root() / "gguf" / key


def resolve_cached(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(directory, gguf file or None) to load from: a GGUF's dequantized cache once it is complete."""
    folder, gguf = split_source(path)
    if gguf:
        cached = gguf_cache_dir(folder, gguf)
        if (cached / ".complete").exists():
            return cached, None
    return folder, gguf


# tokenizer classes that are transformers' generic `tokenizers`-backed class (one class in
# transformers 5, two names): loaded through that class, AutoTokenizer's own choice for them
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: Path, gguf: str | None):
    """The family's tokenizer. A folder whose tokenizer_config.json names the generic tokenizers-backed
    class (the default family's cache, the tests' tiny families) is read through that class directly:
    AutoTokenizer would load the same class after importing model configurations (~3 s of a gateway's
    start on 2 cores against ~0.8 s)."""
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        if gguf is None and _tokenizer_class(folder) in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
            return PreTrainedTokenizerFast.from_pretrained(folder)
        from transformers import AutoTokenizer  # noqa: PLC0415
        return AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer found; token ids only", source=str(folder), error=str(e)[:200])
        return None


def _tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
