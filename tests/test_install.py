"""The install a user gets: the locks resolve from the public index alone, as pinned.

The resolve is uv's, the installer `make setup` runs, with no configuration read (``--no-config`` and no
``UV_*`` variables; uv never reads pip's, so this machine's local package mirror is out of it): it
resolves what a user's machine resolves. It fails on a conflict, on a pinned package resolved to another
version, and on a package resolved that no lock pins (the CUDA build of torch brings its nvidia-* /
cuda-* packages and triton, pinned by torch itself)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = ("nvidia-", "cuda-")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _norm_pin(line: str) -> tuple[str, str]:
    name, sep, version = line.partition(";")[0].strip().partition("==")
    assert sep, f"uv wrote {line!r}, not NAME==VERSION"
    return _norm(name), version


def read_lock(path: Path) -> dict[str, str]:
    """name -> pinned version, following ``-r`` lines, of the pins whose environment marker holds on this
    Python; anything but ``name==version[; marker]`` is an error."""
    from packaging.markers import Marker
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            pins.update(read_lock(path.parent / line[3:].strip()))
            continue
        line, _, marker = (part.strip() for part in line.partition(";"))
        if marker and not Marker(marker).evaluate():
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version and " " not in line, f"{path.name}: {raw!r} is not NAME==VERSION"
        assert _norm(name) not in pins, f"{path.name}: {name} pinned twice"
        pins[_norm(name)] = version
    return pins


def test_the_locks_pin_torch_and_the_image_lock_leaves_out_the_tests():
    serve, dev = read_lock(ROOT / "requirements.lock"), read_lock(ROOT / "requirements-dev.lock")
    assert serve["torch"] == dev["torch"] and "triton" not in serve and "pytest" not in serve
    assert set(serve) < set(dev)
    makefile = (ROOT / "Makefile").read_text()
    assert "sed -n 's/^torch==/torch==/p' requirements.lock" in makefile  # the Makefile's torch is the lock's


@pytest.mark.slow
def test_the_locks_resolve_as_pinned_from_the_public_index_alone(tmp_path):
    uv = Path(sys.executable).with_name("uv")
    assert uv.exists(), f"{uv} is missing: `make setup` installs uv (pinned in requirements.lock)"
    out = tmp_path / "resolved.txt"
    cmd = [str(uv), "pip", "compile", "--no-config", "--no-cache", "--index-url", "https://pypi.org/simple",
           "--python", sys.executable, "--no-header", "--no-annotate", "--quiet", "--output-file", str(out),
           str(ROOT / "requirements-dev.lock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env)
    if res.returncode != 0 and any(s in res.stderr for s in ("dns error", "tcp connect error", "timed out")):
        pytest.skip(f"the public index cannot be reached from here: {res.stderr.strip()[-300:]}")
    assert res.returncode == 0, f"the locks do not resolve from the public index alone:\n{res.stderr[-3000:]}"
    resolved = dict(_norm_pin(line) for line in out.read_text().splitlines() if line.strip())
    pins = read_lock(ROOT / "requirements-dev.lock")
    wrong = {n: (v, resolved.get(n)) for n, v in pins.items() if resolved.get(n) != v}
    assert not wrong, f"pinned -> resolved: {wrong}"
    unpinned = sorted(n for n in resolved if n not in pins and not n.startswith(CUDA_ONLY))
    assert not unpinned, f"resolved but pinned by no lock: {unpinned}"
