"""`mfs bench linears`: one decode step's matmuls per weight format — every CPU format of the registry
(:data:`worker.formats.FORMATS`: fp32, int8, int4, w8a8, w4a8, and any format added there), each shape
packed as serving packs it (the head by the format's head scheme), plus the int8 kernel serving does
not take beside the one it does where our operators build — on a model's linear shapes (default:
SmolLM2-135M's), at batch 1 and 16. Random weights: only shapes and bytes matter for speed."""
from __future__ import annotations

import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from torch import nn

from kernels.cpu_gemv import int8_gemv_kernel, isa, load as load_cpu_gemv
from worker.formats import FORMATS, Int8Linear, pack, resolve
from engine.runtime import write_json

# (name, in, out, per-step count in the 30-layer model)
SMOLLM2_SHAPES = [("q/o 576->576", 576, 576, 60), ("k/v 576->192", 576, 192, 60),
                  ("gate/up 576->1536", 576, 1536, 60), ("down 1536->576", 1536, 576, 30),
                  ("head 576->49152", 576, 49152, 1)]


def _torch_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float()


def _int8_on(kernel):
    """An Int8Linear held on the given rows kernel (torch's or ours, whichever serving does not take)."""
    def make(w: torch.Tensor, is_head: bool) -> Int8Linear:
        lin = Int8Linear.from_float(w)
        lin.rows_kernel = kernel
        return lin
    return make


def _ours_build() -> bool:
    try:
        load_cpu_gemv()
        return True
    except (RuntimeError, OSError):
        return False


def _formats(group: int) -> dict:
    """The formats to time: each registered format that runs on this CPU (a format whose needs this
    machine lacks, e.g. w4a8 without our operators, is left out and said), by ``--weights`` name (with
    ``-g{group}`` where its scales go per ``--group``, as int4's); where our operators build, the other
    int8 kernel beside serving's (``int8-torch`` or ``int8-mfs``). Each maker takes (weight, is_head)."""
    fmts = {}
    for name in FORMATS:
        try:
            cfg = resolve(name, "cpu", group=FORMATS[name].group or group)
        except ValueError as e:
            print(f"bench linears: {name} left out: {e}")
            continue
        fmts[f"{name}-g{group}" if FORMATS[name].takes_group else name] = _packer(cfg)
    if _ours_build():
        fmts["int8-torch" if int8_gemv_kernel() is not None else "int8-mfs"] = \
            _int8_on(_torch_int8 if int8_gemv_kernel() is not None else torch.ops.mfs.int8_gemv)
    return fmts


def _packer(cfg):
    def make(w: torch.Tensor, is_head: bool) -> nn.Module:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w, requires_grad=False)
        return pack(lin, cfg, is_head)
    return make


def measure(shapes=SMOLLM2_SHAPES, batches=(1, 16), reps: int = 7, group: int = 32) -> list[dict]:
    """Each format holds every weight of a step (per_step copies of each shape, as the model does), so
    a pass streams them from memory as a decode step does, not from cache. Per shape: the median call
    time over reps; the step: the fastest whole pass (other jobs share these cores)."""
    rows = {(name, b): {"shape": name, "in": k, "out": n, "per_step": c, "batch": b}
            for name, k, n, c in shapes for b in batches}
    steps: dict[str, dict[str, float]] = {str(b): {} for b in batches}
    gen = torch.Generator().manual_seed(0)
    for fmt, make in _formats(group).items():
        mods = [(name, make(torch.randn(n, k, generator=gen) * 0.02, name.startswith("head")))
                for name, k, n, c in shapes for _ in range(c)]
        with torch.inference_mode():
            for b in batches:
                xs = {k: torch.randn(b, k) for _, k, _, _ in shapes}
                ins = {name: xs[k] for name, k, _, _ in shapes}
                calls: dict[str, list[float]] = {name: [] for name, *_ in shapes}
                totals = []
                for r in range(reps + 1):
                    t_step = time.perf_counter()
                    for name, fn in mods:
                        t0 = time.perf_counter()
                        fn(ins[name])
                        if r:
                            calls[name].append(time.perf_counter() - t0)
                    if r:  # the first pass warms up
                        totals.append(time.perf_counter() - t_step)
                for name, *_ in shapes:
                    rows[(name, b)][fmt + "_us"] = 1e6 * statistics.median(calls[name])
                steps[str(b)][fmt] = 1e3 * min(totals)
        del mods
    return list(rows.values()), steps


def measure_argmax(vocab: int = SMOLLM2_SHAPES[-1][2], batches=(1, 16), reps: int = 200) -> list[dict] | None:
    """Greedy decoding's choice over the head's logits [batch, vocab]: ``mfs::argmax_rows`` (what serving
    takes where it builds) against ``torch.argmax``, alternated call by call; medians. None where the
    operator does not build (serving then takes torch's)."""
    from kernels.cpu_argmax import argmax_kernel  # noqa: PLC0415
    op = argmax_kernel()
    if op is None:
        return None
    out = []
    for b in batches:
        x = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b))
        assert torch.equal(op(x), torch.argmax(x, dim=-1))  # the same answer, or the timing means nothing
        times: dict[str, list[float]] = {"mfs": [], "torch": []}
        for _ in range(reps):
            for name, fn in (("mfs", op), ("torch", lambda t: torch.argmax(t, dim=-1))):
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
        mfs, ref = (1e6 * statistics.median(times[k]) for k in ("mfs", "torch"))
        out.append({"batch": b, "vocab": vocab, "mfs_us": mfs, "torch_us": ref, "speedup": ref / mfs})
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("linears", help="each weight format's matmuls on the model's shapes, batch 1 and 16")
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--gguf", action="store_true",
                   help="instead: --weights gguf's operator on a 1B Q4_K_M's linears (benches/linears_gguf.py)")
    p.add_argument("--batches", default="1,16,1024", help="with --gguf: the batch sizes")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf:
        return _run_gguf(args)
    rows, totals = measure(reps=args.reps, group=args.group)
    fmts = [k[:-3] for k in rows[0] if k.endswith("_us")]
    print(f"{'shape':<20}{'batch':>6}" + "".join(f"{f + ' us':>14}" for f in fmts))
    for r in rows:
        print(f"{r['shape']:<20}{r['batch']:>6}" + "".join(f"{r[f + '_us']:>14.1f}" for f in fmts))
    for b, t in totals.items():
        print(f"one decode step's linears (fastest pass), batch {b}: " + ", ".join(f"{f} {v:.1f} ms" for f, v in t.items()))
    argmax = measure_argmax()
    for a in argmax or []:
        print(f"greedy argmax over [{a['batch']}, {a['vocab']}]: mfs::argmax_rows {a['mfs_us']:.1f} us, "
              f"torch.argmax {a['torch_us']:.1f} us ({a['speedup']:.1f}x)")
    if argmax is None:
        print("greedy argmax: mfs::argmax_rows does not build here (serving takes torch.argmax)")
    if args.json:
        res = {"benchmark": "linears", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "mfs_operators_isa": isa() if _ours_build() else None,
                           "torch": torch.__version__},
               "rows": rows, "step_ms": totals, "argmax": argmax}
        write_json(args.json, res)
    return 0


def _run_gguf(args) -> int:
    from benches.linears_gguf import measure as measure_gguf  # noqa: PLC0415
    rows = measure_gguf(batches=tuple(int(b) for b in args.batches.split(",")), reps=args.reps)
    if args.json:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_json(args.json, {"benchmark": "linears-gguf", "date": date,
                               "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                                           "mfs_operators_isa": isa(), "torch": torch.__version__},
                               "rows": rows})
    return 0
