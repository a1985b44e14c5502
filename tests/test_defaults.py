"""The defaults that are the product: every command that serves takes ``--weights auto``;
`mfs up` asks its workers for compiled decode where it builds (``--no-compile`` opts out, ``--compile``
refuses where it cannot); a worker's threads are the cores it has, split when several share them; the
compose worker serves the same way. No model is loaded here."""
import os
from pathlib import Path

import pytest
import yaml

from mfs.cli import build_parser
from mfs.commands import chosen, compile_choice
from service.launch import Service, worker_threads

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_up_and_generate_serve_auto_weights_and_compiled_decode_by_default():
    up = _args("up")
    assert up.weights == "auto" and up.threads == 0 and compile_choice(up) == "auto"
    assert compile_choice(_args("up", "--no-compile")) == "off"
    assert compile_choice(_args("up", "--compile")) == "on"
    assert _args("generate", "hi").weights == "auto"
    assert _args("up", "--weights", "fp32").weights == "fp32"


@pytest.mark.parametrize("argv, error", [
    (["--compile", "--device", "cuda", "--kernels", "torch"], "CUDA graphs of the Triton ops"),
    (["--compile", "--weights", "w8a8"], "does not serve --weights w8a8"),
])
def test_an_explicit_compile_is_refused_where_it_cannot_be_built(argv, error):
    with pytest.raises(ValueError, match=error):
        compile_choice(_args("up", *argv))
    assert compile_choice(_args("up", *argv[1:])) == "auto"  # the default: eager there, said at start


def test_the_start_line_says_what_was_chosen_and_why():
    import torch
    args = _args("up", "--workers", "2", "--no-compile")
    args.compile = compile_choice(args)
    line = chosen(args, 3)
    isa = torch.backends.cpu.get_cpu_capability()
    assert line.startswith(f"{isa} on cpu; weights ") and f"(auto on {isa})" in line
    assert "3 torch threads per worker (the cores split between 2 worker(s))" in line
    assert line.endswith("decode eager (--no-compile)")


def test_a_failed_operator_build_is_named_in_the_start_line(tmp_path):
    """Where our CPU operators do not build, ``auto`` serves int4 and the start line says why, with the
    compiler's failure; ``--weights w4a8`` asked for them and is refused with the same cause."""
    import subprocess
    import sys

    import torch
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("auto serves fp32 on this CPU whether or not the operators build")
    script = ("from mfs.cli import build_parser\nfrom mfs.commands import chosen\n"
              "a = build_parser().parse_args(['up', '--no-compile']); a.compile = 'off'\nprint(chosen(a, 1))\n"
              "from worker.formats import resolve\n"
              "try:\n    resolve('w4a8')\nexcept ValueError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "CXX": "/bin/false", "MFS_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True).stdout
    line = next(ln for ln in out.splitlines() if " on cpu; weights " in ln)  # stdout has the log lines too
    refused = next(ln for ln in out.splitlines() if ln.startswith("refused: "))
    assert "weights int4 (auto on " in line and "not w4a8, our CPU operators are unavailable (build failed: " in line
    assert refused.startswith("refused: --weights w4a8 needs our CPU operators") and "/bin/false failed" in refused


def test_threads_are_the_cores_split_between_the_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [worker_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    from worker.service import WorkerConfig
    assert WorkerConfig().threads == 8 and WorkerConfig().compile == "off"  # the process's own defaults


@pytest.mark.parametrize("worker_args, want", [([], ["--threads", "2"]), (["--threads", "3"], ["--threads", "3"])])
def test_the_launcher_splits_threads_unless_told(monkeypatch, worker_args, want):
    """Four cores, two workers: two threads each; a --threads given is passed as given, alone."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Service, "spawn", lambda self, spec: spawned.__setitem__(spec.name, list(spec.args)))
    monkeypatch.setattr(Service, "wait_workers", lambda self, timeout, n: None)
    Service("default", workers=2, gateway=False, redis_url="redis://127.0.0.1:1/0", worker_args=worker_args).start()
    workers = [a for name, a in spawned.items() if name.startswith("worker")]
    assert len(workers) == 2
    for a in workers:
        i = a.index("--threads")
        assert a[i:i + 2] == want and a.count("--threads") == 1



@pytest.mark.parametrize("argv, want", [([], None), (["--kv-cache-mb", "1024"], "1024")])
def test_mfs_up_passes_the_kv_budget_to_its_workers_only_when_given(argv, want):
    from mfs.cli import build_parser
    from mfs.up import service_from_args
    args = build_parser().parse_args(["up", *argv])
    args.compile = "off"
    wa = service_from_args(args).worker_args
    assert (wa[wa.index("--kv-cache-mb") + 1] if "--kv-cache-mb" in wa else None) == want


@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_a_kv_budget_below_one_mb_is_refused_by_mfs_up_and_the_worker(value, capsys):
    import argparse

    from core.cli import add_args
    from mfs.cli import build_parser
    from worker.service import WorkerConfig
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-cache-mb", value])
    worker = argparse.ArgumentParser(prog="worker")
    add_args(worker, WorkerConfig)
    with pytest.raises(SystemExit):
        worker.parse_args(["--kv-cache-mb", value])
    err = capsys.readouterr().err
    assert err.count(f"--kv-cache-mb: must be a whole number of at least 1, got {value!r}") == 2

def test_the_compose_worker_serves_as_mfs_up_does():
    worker = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["worker"]
    cmd = worker["command"][-1]
    assert "--weights auto" in cmd and "--compile auto" in cmd and "--threads" not in cmd  # threads: its cores
    assert worker["environment"]["MFS_CACHE"] == "/cache" and "mfs-cache:/cache" in worker["volumes"]
