"""Our CPU matmul operators (AVX2; AVX-512 VNNI where the CPU has it) (``kernels/cpu_gemv*.cpp`` with
``cpu_gemv.h``: one library), built with the machine's C++ compiler against the installed torch on first use and loaded with ``torch.ops.load_library``:

* ``mfs::int8_gemv`` — int8 weights, fp32 activations. On an AVX2 CPU torch's ``_weight_int8pack_mm``
  streams int8 weights at ~8 GB/s (two threads; it reads four weight rows side by side, which the
  prefetchers there lose, while the memory reads ~20 GB/s) and rounds the activations to bf16. This
  one reads one weight row at a time front to back, widens each weight to fp32 once per pair of
  activation rows, and keeps the activations fp32.
* ``mfs::w4a8_gemv`` — Q4_1 weight blocks times activations quantized per 32 values to 8 bits
  (``--weights w4a8``, ``worker.formats.Q4A8Linear``), one weight row's blocks across a register.
* ``mfs::w4a8_tile_gemv`` — the same sum over the same bytes interleaved 16 weight rows to a tile
  (:func:`tile_q4_rows`): a register lane is one output, so a block's integer sum takes 8 vpdpbusd
  for 16 rows and its scaling 4 instructions for all 16; what ``Q4A8Linear`` serves where N % 16 == 0.
* ``mfs::int8_a8_gemv`` — int8 weights (one scale per row) times the same 8-bit activations: the LM
  head of ``--weights w4a8`` (``worker.formats.Int8A8Linear``); ``mfs::int8_a8_tile_gemv`` the same over
  weights interleaved 16 rows to a tile (:func:`tile_int8_rows`), what that head serves where N % 16 == 0.

A row's output is the same bit for bit at any batch size (the C++ file says why). Being real torch
operators (not Python custom ops), a compiled decode graph calls them from C++ like any aten op: no
Python per call.

:func:`int8_gemv_kernel` is what ``worker.formats.Int8Linear`` takes: this kernel where torch reports
the CPU capability ``AVX2`` or ``AVX512`` and the build succeeds, else None (torch's kernel). Measured
on both machines (docs/journal/benchmarks-history.md, "Kernels of our own"): about twice torch's int8 kernel's speed
at one row on each, and faster than inductor's compiled int8 head on the AVX-512 one. ``MFS_CPU_GEMV=0``
turns it off. The choice is logged once per process.

The build: ``g++ -O3 -mavx2 -mfma -mf16c -fopenmp`` and the C++ standard torch's own extension
builder asks for (:func:`cxx_standard`), with torch's headers (plus
``-mavx512f -mavx512bw -mavx512vl -mavx512vnni`` where the CPU has AVX-512 VNNI: :func:`isa`), each
source file compiled on its own thread, then linked ``-shared`` into
``$MFS_CACHE/kernels/<hash of sources, headers, compiler, flags, torch version>/`` (``~/.cache/mfs`` by
default), under a file lock, once per machine. The library links ``libgomp.so.1`` by soname, which is
the OpenMP runtime torch has already loaded, so the two share one thread pool.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import structlog
import torch

from kernels import switches

log = structlog.get_logger(__name__)

_HERE = Path(__file__).parent
# one library: the operators' files (cpu_gemv.cpp registers them all; cpu_gemv.h is what they share)
SOURCES = tuple(_HERE / f for f in ("cpu_gemv.cpp", "cpu_gemv_w4a8.cpp", "cpu_gemv_w4a8_tile.cpp", "cpu_gemv_a8.cpp"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-w"]
# where the CPU has AVX-512 VNNI, w4a8's block sums take one vpdpbusd instead of vpmaddubsw + vpmaddwd
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa() -> str:
    """The instruction set the operators are built for: ``avx512-vnni`` where the CPU has it, else
    ``avx2``; ``MFS_CPU_GEMV_ISA=avx2`` asks for the AVX2 build anyway (to compare the two)."""
    want = switches.current().cpu_gemv_isa
    if want == "avx512-vnni" and not VNNI <= cpu_flags():
        raise ValueError("MFS_CPU_GEMV_ISA=avx512-vnni, but this CPU lacks " + ", ".join(sorted(VNNI - cpu_flags())))
    if want:
        return want
    return "avx512-vnni" if VNNI <= cpu_flags() else "avx2"


def cxx_standard() -> str:
    """The C++ standard the installed torch's headers need: the newest ``-std=c++NN`` that torch's own
    extension builder (``torch.utils.cpp_extension``) passes, so the operators build against whichever
    torch they meet (torch 2.13 passes C++20; newer torch headers do not compile under C++17)."""
    import re  # noqa: PLC0415
    from torch.utils import cpp_extension  # noqa: PLC0415
    found = re.findall(r"-std=c\+\+(\d+)", Path(cpp_extension.__file__).read_text())
    return f"-std=c++{max(found, key=int)}" if found else "-std=c++17"


def flags(target: str | None = None) -> list[str]:
    """The compiler's flags for ``target`` (``avx2`` or ``avx512-vnni``; default :func:`isa`)."""
    return [*FLAGS, cxx_standard(), *(VNNI_FLAGS if (target or isa()) == "avx512-vnni" else [])]


def _cache_dir() -> Path:
    return Path(os.environ.get("MFS_CACHE", Path.home() / ".cache" / "mfs")) / "kernels"


def _compile(cxx: str, source: Path, out: str, target: str | None = None) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only for a build)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [cxx, *flags(target), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *incs, "-c", str(source), "-o", out]


def _link(cxx: str, objects: list[str], out: str, target: str | None = None) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only for a build)
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [cxx, *flags(target), "-shared", *objects, "-o", out, *libs, "-lc10", "-ltorch_cpu"]


def _run(cmd: list[str], cxx: str, what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{cxx} failed on {what}: {res.stderr.strip()[-2000:]}")


def build(sources: Path | Sequence[Path] = SOURCES, cxx: str | None = None,
          headers: Sequence[Path] | None = None, target: str | None = None) -> Path:
    """The operator library of ``sources`` (one file, several linked together, or a folder's
    cpu_gemv*.cpp — an older checkout's kernels/ for A/B probes), compiled once into the cache, each
    source on its own thread. ``headers``: what they include, part of the cache key (default: every .h
    beside them). ``target``: the instruction set to build for (default :func:`isa`, this CPU's; a library
    built for another is there to show that it compiles, and this CPU may not load it). Raises RuntimeError
    with the compiler's message if it fails."""
    if isinstance(sources, Path):
        sources = sorted(sources.glob("cpu_gemv*.cpp")) if sources.is_dir() else [sources]
    sources = sorted(sources)  # one cache entry per set of sources, whatever order they came in
    if not sources:
        raise ValueError("no cpu_gemv*.cpp source to build")
    if headers is None:
        headers = sorted({h for p in sources for h in p.parent.glob("*.h")})
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    text = b"".join(p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(text + " ".join([cxx, *flags(target), torch.__version__]).encode()).hexdigest()[:16]
    folder = _cache_dir() / key
    lib = folder / "libmfs_cpu_gemv.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another process built it while this one waited
            return lib
        log.info("building our CPU operators (once per machine, ~10 s)", sources=[p.name for p in sources],
                 isa=target or isa(), into=str(folder))
        with tempfile.TemporaryDirectory(dir=folder) as work:
            objects = [str(Path(work) / f"{p.stem}.o") for p in sources]
            with ThreadPoolExecutor(len(sources)) as pool:
                for done in [pool.submit(_run, _compile(cxx, p, o, target), cxx, p.name) for p, o in zip(sources, objects)]:
                    done.result()
            tmp = str(Path(work) / lib.name)
            _run(_link(cxx, objects, tmp, target), cxx, "linking " + ", ".join(p.name for p in sources))
            os.replace(tmp, lib)  # atomic: a reader never loads a half-written library
    return lib


_background: dict[tuple, threading.Thread] = {}


def build_in_background(sources: Sequence[Path] = SOURCES, switch: str = "MFS_CPU_GEMV") -> threading.Thread | None:
    """Starts :func:`build` of ``sources`` on a thread (once per process) where :func:`pick_operator`
    would load them (a CPU with AVX2 or AVX-512, ``switch`` not 0: kernels/switches.py), so a cold
    start's compile (~10 s) overlaps the work before their first use (reading and dequantizing the
    weights). Best effort: a failure is left for the loader, which builds again (after this thread, by
    the cache's lock) and reports it."""
    if not switches.current().operator_on(switch) or \
            torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    key = tuple(sorted(str(p) for p in sources))
    if key in _background:
        return _background[key]

    def run() -> None:
        try:
            build(list(sources))
        except (RuntimeError, OSError, ValueError):
            pass
    t = _background[key] = threading.Thread(target=run, daemon=True, name="build-cpu-operators")
    t.start()
    return t


_loaded: list[bool] = []


def load() -> None:
    """Builds (if needed) and loads the library once per process; registers the operator's shape
    function for torch.compile."""
    if _loaded:
        return
    torch.ops.load_library(str(build()))

    @torch.library.register_fake("mfs::int8_gemv")
    def _(x, q, scales):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("mfs::w4a8_gemv")
    def _(x, q, dm):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("mfs::w4a8_tile_gemv")
    def _(x, qt, dmt):
        return x.new_empty(x.shape[0], qt.shape[0] * 16)

    @torch.library.register_fake("mfs::int8_a8_tile_gemv")
    def _(x, qt, scales):
        return x.new_empty(x.shape[0], qt.shape[0] * 16)

    @torch.library.register_fake("mfs::int8_a8_gemv")
    def _(x, q, scales):
        return x.new_empty(x.shape[0], q.shape[0])

    _loaded.append(True)


def pack_q4_rows(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] integers in 0..15 (K % 32 == 0) -> uint8 [N, K / 2] in ``w4a8_gemv``'s layout (Q4_1's):
    per 32 inputs 16 bytes, byte j holding input j (low nibble) and input j + 16 (high nibble)."""
    N, K = u.shape
    if K % 32:
        raise ValueError(f"4-bit rows need K % 32 == 0, got K = {K}")
    b = u.to(torch.uint8).view(N, K // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def unpack_q4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_q4_rows`: uint8 [N, K / 2] -> uint8 [N, K] in 0..15."""
    N, H = packed.shape
    b = packed.view(N, H // 16, 16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(N, 2 * H)


def tile_q4_rows(packed: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_q4_rows`' uint8 [N, K / 2] and Q4_1's fp16 (d, m) [N, K / 32, 2] -> ``w4a8_tile_gemv``'s
    tiles of 16 rows (N % 16 == 0): qt uint8 [N / 16, K / 32, 4, 16, 4], qt[t, b, p, j, i] = row 16t + j's
    byte 4p + i of block b, and dmt fp16 [N / 16, K / 32, 2, 16] (the 16 rows' d, then their m). The
    same bytes, reordered."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] % 16:
        raise ValueError(f"packed must be uint8 [N, K / 2] with K % 32 == 0, got {packed.dtype} "
                         f"{list(packed.shape)}")
    N, H = packed.shape
    if N % 16:
        raise ValueError(f"tiles of 16 rows need N % 16 == 0, got N = {N}")
    B = H // 16
    if dm.shape != (N, B, 2) or dm.dtype != torch.float16:
        raise ValueError(f"dm must be fp16 [N, K / 32, 2] = [{N}, {B}, 2] for packed {list(packed.shape)}, "
                         f"got {dm.dtype} {list(dm.shape)}")
    qt = packed.view(N // 16, 16, B, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    dmt = dm.view(N // 16, 16, B, 2).permute(0, 2, 3, 1).contiguous()
    return qt, dmt


def untile_q4_rows(qt: torch.Tensor, dmt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`tile_q4_rows`."""
    T, B = qt.shape[:2]
    packed = qt.permute(0, 3, 1, 2, 4).reshape(T * 16, B * 16).contiguous()
    dm = dmt.permute(0, 3, 1, 2).reshape(T * 16, B, 2).contiguous()
    return packed, dm


def tile_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (N % 16 == 0, K % 32 == 0) -> ``int8_a8_tile_gemv``'s tiles of 16 rows, int8
    [N / 16, K / 32, 8, 16, 4]: qt[t, b, c, j, i] = q[16t + j, 32b + 4c + i]. The same bytes, reordered."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be int8 [N, K], got {q.dtype} {list(q.shape)}")
    N, K = q.shape
    if N % 16 or K % 32:
        raise ValueError(f"tiles of 16 rows need N % 16 == 0 and K % 32 == 0, got [{N}, {K}]")
    return q.view(N // 16, 16, K // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def untile_int8_rows(qt: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tile_int8_rows`."""
    T, B = qt.shape[:2]
    return qt.permute(0, 3, 1, 2, 4).reshape(T * 16, B * 32).contiguous()


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq int8 [M, K], dx fp32 [M, K / 32]) as ``w4a8_gemv`` quantizes them: per 32
    values dx = amax / 127 and xq = round-half-even(x / dx)."""
    M, K = x.shape
    xb = x.float().view(M, K // 32, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).to(torch.int8).view(M, K), d


def w4a8_gemv_reference(x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """``mfs::w4a8_gemv`` in float64 from the same quantized activations (tests)."""
    xq, dx = quantize_activations_q8(x)
    M, K = x.shape
    u = unpack_q4_rows(q).double().view(q.shape[0], K // 32, 32)
    xqb = xq.double().view(M, K // 32, 32)
    dot = torch.einsum("mbj,nbj->mnb", xqb, u)                      # exact integer sums
    xs = dx.double() * xqb.sum(-1)                                  # [M, B]
    d, mn = dm[..., 0].double(), dm[..., 1].double()                # [N, B]
    return (dot * dx.double()[:, None, :] * d[None] + xs[:, None, :] * mn[None]).sum(-1).float()


def int8_a8_gemv_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``mfs::int8_a8_gemv`` in float64 from the same quantized activations (tests)."""
    xq, dx = quantize_activations_q8(x)
    M, K = x.shape
    dot = torch.einsum("mbj,nbj->mnb", xq.double().view(M, K // 32, 32), q.double().view(q.shape[0], K // 32, 32))
    return ((dot * dx.double()[:, None, :]).sum(-1) * scales.double()[None]).float()


def load_once(loaded: list, source: Path, register: Callable[[], None]) -> None:
    """Builds (if needed) and loads the operator library of ``source`` once per process, then calls
    ``register`` (its shape functions); ``loaded`` (a list, empty until then) remembers it."""
    if loaded:
        return
    torch.ops.load_library(str(build(source)))
    register()
    loaded.append(True)


# operator name -> why :func:`pick_operator` left it to the fallback (what a start line reports)
unavailable: dict[str, str] = {}


def pick_operator(cache: list, switch: str, load_lib: Callable[[], None], name: str, what: str, fallback: str,
                  detail: str = "") -> Callable | None:
    """``torch.ops.mfs.<name>`` (``load_lib()`` builds and loads its library) on a CPU where torch reports
    AVX2 or AVX512, unless ``switch`` (kernels/switches.py) is 0 or the build fails: then None, and the
    caller's ``fallback`` serves. Decided once per process into ``cache`` (a list, empty until then) and
    logged as ``what``."""
    if cache:
        return cache[0]
    cap = torch.backends.cpu.get_cpu_capability()
    unavailable.pop(name, None)
    kernel, why = None, None
    if not switches.current().operator_on(switch):
        why = f"{switch}=0"
    elif cap not in ("AVX2", "AVX512"):
        why = f"cpu capability {cap} (the operators need AVX2)"
    else:
        try:
            load_lib()
            kernel = getattr(torch.ops.mfs, name)
        except (RuntimeError, OSError) as e:
            why = f"build failed: {e}"
    log.info(what, kernel=f"mfs::{name} ({isa()}{detail})" if kernel else fallback, cpu_capability=cap,
             **({"why": why} if why else {}))
    if why:
        unavailable[name] = why
    cache.append(kernel)
    return kernel


_choice: list = []


def int8_gemv_kernel() -> Callable | None:
    """The operator ``torch.ops.mfs.int8_gemv`` on a CPU where torch reports AVX2 or AVX-512 and our
    operators build, else None (torch's kernel); decided and logged once per process."""
    return pick_operator(_choice, "MFS_CPU_GEMV", load, "int8_gemv", "int8 linear kernel",
                         "_weight_int8pack_mm (bf16)", detail=", fp32")


__all__ = ["build", "load", "load_once", "pick_operator", "int8_gemv_kernel", "pack_q4_rows",
           "unpack_q4_rows", "tile_q4_rows", "untile_q4_rows", "tile_int8_rows", "untile_int8_rows", "quantize_activations_q8", "w4a8_gemv_reference",
           "int8_a8_gemv_reference"]
