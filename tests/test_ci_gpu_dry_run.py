"""`.ci/gpu --dry-run`: the prepared GPU run's steps on the CPU (triton's interpreter, tiny random models,
no graphs captured), so the script a lent GPU machine runs cannot rot between the rare runs it gets.
Each step must pass, OUT must hold at most 8 files, and its parts must unpack into the results each
step writes. The service step is left to tests/test_gpu_service.py (the same test body, already in CI)."""
import json
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _unpack(out: Path) -> dict[str, bytes]:
    data = b"".join(p.read_bytes() for p in sorted(out.glob("results.tar.gz.part*")))
    with tarfile.open(fileobj=BytesIO(data), mode="r:gz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_the_gpu_script_runs_its_steps_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(["bash", ".ci/gpu", "--dry-run", str(out), "kernels", "engine", "joint"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    lines = dict(line.split(None, 2)[1::-1] for line in summary.splitlines())
    assert {lines.get(s) for s in ("kernels", "kernel-tests", "engine-1b")} == {"ok"}, summary
    assert lines.get("engine-default") == "skipped", summary  # the dry run's would be engine-1b's again
    assert lines.get("joint") in ("ok", "skipped"), summary  # skipped: a tree without --method joint
    assert len(list(out.iterdir())) <= 8
    files = _unpack(out)
    kernels = json.loads(files["kernels.json"])
    assert kernels["cuda"] is False and kernels["correctness"]["ok"]
    quant = [c for c in kernels["correctness"]["checks"] if c["kernel"].startswith("quant_matmul")]
    assert quant and all(c["err_over_bound"] <= 1 for c in quant)
    eng = json.loads(files["engine-1b.json"])
    assert set(eng["regimes"]) == {"compute", "decode"} and eng["machine"]["device"] == "cpu"
    assert eng["regimes"]["decode"]["nested"]["tokens"] == eng["regimes"]["decode"]["independent"]["tokens"] > 0


def test_the_gpu_script_refuses_unknown_steps_and_a_missing_gpu(tmp_path):
    res = subprocess.run(["bash", ".ci/gpu", "--dry-run", str(tmp_path / "a"), "nonsense"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown step nonsense" in res.stderr
    import torch
    if torch.cuda.is_available():
        return  # a real run would start here
    res = subprocess.run(["bash", ".ci/gpu", str(tmp_path / "b"), "kernels"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": str(ROOT / ".venv/bin/python")})
    assert res.returncode == 2 and "no CUDA device" in res.stderr
