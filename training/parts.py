"""An artifact in parts: a weights file cut into pieces of at most ``max_bytes`` (15 MB by default, what
a device machine's output hands back per file), with a sha256 manifest, and the reverse.

``OUT/parts/parts.json``: ``{"file": NAME, "bytes": N, "sha256": HEX, "parts": [{"name", "bytes",
"sha256"}, ...]}``. :func:`assemble` (``mfs precipitate --assemble OUT``) checks every part and the
whole, then writes ``OUT/NAME`` next to ``OUT/mfs.json``, so ``mfs eval --model OUT`` reads it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

PART_BYTES = 15_000_000
MANIFEST = "parts.json"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(path: Path, out_dir: Path, max_bytes: int = PART_BYTES) -> Path:
    """Writes ``path`` as parts under ``out_dir`` (earlier parts removed); returns the manifest."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be >= 1")
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{path.name}.part*"):
        old.unlink()
    data = path.read_bytes()
    parts = []
    for i in range(0, max(1, len(data)), max_bytes):
        chunk = data[i:i + max_bytes]
        name = f"{path.name}.part{len(parts):03d}"
        (out_dir / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": _sha(chunk)})
    man = {"file": path.name, "bytes": len(data), "sha256": _sha(data), "parts": parts}
    (out_dir / MANIFEST).write_text(json.dumps(man, indent=2) + "\n")
    return out_dir / MANIFEST


def assemble(folder: Path) -> Path:
    """Joins ``folder/parts/`` into ``folder/<file>``, every sha256 checked; returns the file."""
    folder = Path(folder)
    man_path = folder / "parts" / MANIFEST
    if not man_path.exists():
        raise FileNotFoundError(f"{man_path}: no parts manifest (was the artifact written in parts?)")
    man = json.loads(man_path.read_text())
    if not (folder / "mfs.json").exists():
        raise FileNotFoundError(f"{folder / 'mfs.json'}: the nested checkpoint's manifest is missing")
    chunks = []
    for p in man["parts"]:
        f = folder / "parts" / p["name"]
        if not f.exists():
            raise FileNotFoundError(f"{f}: a part is missing")
        chunk = f.read_bytes()
        if len(chunk) != p["bytes"] or _sha(chunk) != p["sha256"]:
            raise ValueError(f"{f}: size or sha256 differs from {man_path}")
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) != man["bytes"] or _sha(data) != man["sha256"]:
        raise ValueError(f"the joined parts of {man['file']} do not match its sha256 in {man_path}")
    out = folder / man["file"]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out
