"""`mfs bench peers`' llama.cpp check (benches/llama_build.py) and its API contender's arithmetic."""
from __future__ import annotations

import importlib.util

import pytest

from benches import llama_build
from benches.peers_api import summarize_runs

XEON_AMX = frozenset("avx avx2 fma f16c avx512f avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
AVX2_ONLY = frozenset("avx avx2 fma f16c".split())


def test_cmake_args_turn_off_native_and_amx_and_follow_the_cpu():
    amx = llama_build.cmake_args(XEON_AMX).split()
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_BF16=ON" in amx
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(amx)
    avx2 = llama_build.cmake_args(AVX2_ONLY).split()
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_VNNI=OFF" in avx2


def test_a_missing_llama_cpp_is_reported_with_how_to_build_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    usable, note = llama_build.ensure("model.gguf", allow_build=False)
    assert not usable and "not installed" in note and "--build-llama-cpp" in note and "GGML_NATIVE=OFF" in note


@pytest.mark.parametrize("script,state", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed"),   # the AMX build's fault
    ("import sys; sys.exit(3)", "failed"),
    ("print('llama.cpp ok')", "ok"),
])
def test_the_check_tells_a_crash_from_a_failure(monkeypatch, script, state):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(llama_build, "SMOKE", script)
    got = llama_build.check("model.gguf")
    assert got.state == state, got
    if state == "crashed":
        assert "SIGSEGV" in got.detail


def test_a_crash_without_build_permission_is_skipped_not_timed(monkeypatch):
    monkeypatch.setattr(llama_build, "check", lambda gguf: llama_build.Check("crashed", "killed by SIGSEGV"))
    monkeypatch.setattr(llama_build, "build", lambda say: pytest.fail("built without --build-llama-cpp"))
    usable, note = llama_build.ensure("m.gguf", allow_build=False)
    assert not usable and "SIGSEGV" in note


def test_a_crash_is_rebuilt_and_checked_again_when_allowed(monkeypatch):
    states = iter([llama_build.Check("crashed", "killed by SIGSEGV"), llama_build.Check("ok", "evaluates")])
    built = []
    monkeypatch.setattr(llama_build, "check", lambda gguf: next(states))
    monkeypatch.setattr(llama_build, "build", lambda say: built.append(True))
    usable, note = llama_build.ensure("m.gguf", allow_build=True)
    assert usable and built == [True] and "rebuilt" in note


def test_api_runs_summarize_as_the_in_process_contenders_do():
    runs = [{"start": 0.0, "first": 0.5, "end": 2.5, "tokens": 5}, {"start": 0.0, "first": 1.0, "end": 5.0, "tokens": 5}]
    s = summarize_runs(runs, wall=5.0, new_tokens=5)
    assert s["tokens"] == 10 and s["tokens_per_s"] == 2.0
    assert s["ttft_ms"] == pytest.approx(750.0) and s["tpot_ms"] == pytest.approx(750.0)  # (2/4 + 4/4) / 2 s


def test_the_rebuild_also_installs_what_llama_cpp_python_needs(monkeypatch):
    """The rebuild is --no-deps (it must not reinstall numpy and the rest); a fresh environment then
    lacks llama-cpp-python's own dependencies (it died on `import diskcache`), so a plain install of the
    same version follows, which adds them and leaves the build in place."""
    calls = []
    monkeypatch.setattr(llama_build.subprocess, "run", lambda argv, **kw: calls.append((argv, kw.get("env"))))
    llama_build.build(say=lambda msg: None)
    (rebuild, env), (deps, _) = calls
    assert {"--no-deps", "--force-reinstall"} <= set(rebuild) and "GGML_NATIVE=OFF" in env["CMAKE_ARGS"]
    assert deps[-1] == rebuild[-1] == f"llama-cpp-python=={llama_build.VERSION}"
    assert not {"--no-deps", "--force-reinstall"} & set(deps)
