"""llama.cpp for `mfs bench peers`: found, checked in a child, and rebuilt where the native build dies.

pip builds llama-cpp-python for the machine it builds on (GGML_NATIVE). On Intel Xeons with AMX that
build crashes at the first token (a general protection fault in libggml-cpu's AMX path; seen on such a
machine, docs/journal/provenance.md). So before anything is timed, a child process loads the GGUF and
evaluates two tokens. If it dies by a signal, the bench rebuilds llama-cpp-python (`--build-llama-cpp`) with
GGML_NATIVE=OFF, the x86 options this CPU has turned on and the AMX ones off, checks again, and says
so; without the flag it says how.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from engine.runtime import cpu_flags

VERSION = "0.3.36"  # the version every llama.cpp figure in docs/ was measured with
# GGML option -> the /proc/cpuinfo flag that allows it
ISA_OPTIONS = (("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"), ("AVX512", "avx512f"),
               ("AVX512_VBMI", "avx512vbmi"), ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"))
AMX_OPTIONS = ("AMX_TILE", "AMX_INT8", "AMX_BF16")
SMOKE = ("import sys\nfrom llama_cpp import Llama\n"
         "m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)\n"
         "m.eval([1, 2])\nprint('llama.cpp ok')\n")


@dataclass(slots=True)
class Check:
    state: str   # "ok", "missing", "crashed" or "failed"
    detail: str


def cmake_args(flags: frozenset[str]) -> str:
    """GGML_NATIVE off; each ISA option on exactly when the CPU has it; AMX always off."""
    opts = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{o}={'ON' if f in flags else 'OFF'}" for o, f in ISA_OPTIONS]
    return " ".join(opts + [f"-DGGML_{o}=OFF" for o in AMX_OPTIONS])


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def check(gguf: str, timeout_s: float = 180.0) -> Check:
    if not installed():
        return Check("missing", "llama-cpp-python is not installed")
    try:
        r = subprocess.run([sys.executable, "-c", SMOKE, gguf], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Check("failed", f"two tokens took over {timeout_s:.0f} s")
    if r.returncode < 0:
        return Check("crashed", f"killed by {signal.Signals(-r.returncode).name} at its first tokens")
    if r.returncode != 0 or "llama.cpp ok" not in r.stdout:
        return Check("failed", f"exit {r.returncode}: {(r.stderr or r.stdout)[-300:]}")
    return Check("ok", "loads the GGUF and evaluates tokens")


def build(say=print) -> None:
    args = cmake_args(cpu_flags())
    say(f"building llama-cpp-python=={VERSION} without the native build (about 12 minutes on 2 cores): "
        f"CMAKE_ARGS=\"{args}\"")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--force-reinstall",
                    "--no-deps", f"llama-cpp-python=={VERSION}"], check=True,
                   env=dict(os.environ, CMAKE_ARGS=args, FORCE_CMAKE="1"))
    # --no-deps keeps the rebuild from reinstalling numpy and the rest; on a fresh environment its own
    # dependencies (diskcache, jinja2, ...) are still missing: pip adds them, leaving the build as it is
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"llama-cpp-python=={VERSION}"], check=True)


def ensure(gguf: str, allow_build: bool, say=print) -> tuple[bool, str]:
    """(usable, a note for the bench's output) — the note says what was found and what was done."""
    first = check(gguf)
    if first.state == "ok":
        return True, f"llama.cpp: {first.detail}"
    if not allow_build:
        how = (f"rerun with --build-llama-cpp to build it here without the native build "
               f"(CMAKE_ARGS=\"{cmake_args(cpu_flags())}\")")
        return False, f"llama.cpp skipped: {first.detail}; {how}"
    build(say)
    second = check(gguf)
    note = f"llama.cpp: {first.detail}; rebuilt with GGML_NATIVE=OFF and AMX off: {second.detail}"
    return second.state == "ok", note
