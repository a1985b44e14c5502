"""`mfs bench kernels`: the Triton kernels checked and timed against their torch references.

On CUDA: every kernel is verified against its reference at serving shapes, then timed (median of
``--iters`` calls between CUDA events, L2 flushed before each, host launch cost included) against
the reference, and paged attention also against ``scaled_dot_product_attention`` on the same KV
already gathered contiguous. Then the quantized matmul alone at
SmolLM2-135M's and the 1B model's shapes next to dense bf16 ``F.linear`` and torch's int4 tinygemm
(benches/kernels_quant.py), and last one decode step at batch 1 of a random-weight ~1B Llama and of
the default family's base shape, bf16 and int4, eager and through CUDA graphs, against the
memory-bandwidth floor (benches/kernels_step.py).

Without CUDA there is nothing to time: the command runs the correctness pass on tiny shapes in
triton's CPU interpreter (in a child process, which must import triton with ``TRITON_INTERPRET=1``),
writes ``"cuda": false`` and says that timings need CUDA.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from benches.kernels_common import EPS, H200_BANDWIDTH, SERVE, TINY, Dims, Timer
from benches.kernels_common import randn as _randn
from benches.kernels_quant import quant_checks, time_quant_linears
from benches.kernels_step import time_decode_steps
from engine.runtime import write_json


def add_parser(sub) -> None:
    p = sub.add_parser("kernels", help="Triton kernels vs torch references (timings need CUDA)")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median)")
    p.add_argument("--ctx", type=int, default=1024, help="context of the batch-1 decode step")
    p.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH,
                   help="memory bandwidth in B/s for the decode-step floor (H200: 4.8e12)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


# ---- cases -----------------------------------------------------------------------------------
def paged_case(rows: list[tuple[int, int]], dims: Dims, device: str) -> tuple:
    """Rows of (q_len, ctx_len) over shuffled pool blocks: the paged op's positional args."""
    bs = dims.block_size
    need = [-(-ctx // bs) for _, ctx in rows]
    perm = torch.randperm(sum(need) + 1)
    tables = torch.zeros(len(rows), max(need), dtype=torch.long)
    used = 0
    for r, n in enumerate(need):
        tables[r, :n] = perm[used:used + n]
        used += n
    q_lens, ctx_lens = [q for q, _ in rows], [c for _, c in rows]
    kc = _randn(len(perm), bs, dims.kv_heads, dims.head_dim, dims=dims, device=device)
    vc = _randn(len(perm), bs, dims.kv_heads, dims.head_dim, dims=dims, device=device)
    q = _randn(sum(q_lens), dims.heads, dims.head_dim, dims=dims, device=device)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(device)
    return (q, kc, vc, tables.to(device), starts, torch.tensor(ctx_lens, device=device),
            dims.head_dim ** -0.5, q_lens, ctx_lens)


def _attention_rows(cuda: bool) -> dict[str, list[tuple[int, int]]]:
    if not cuda:
        return {"decode": [(1, 4), (1, 9), (1, 1)], "verify": [(3, 9), (4, 6)],
                "prefill+chunk": [(12, 12), (6, 19), (1, 5)]}
    return {"decode ragged x8": [(1, c) for c in (1, 17, 300, 511, 512, 1000, 1500, 2047)],
            "decode 1x4096 (split KV)": [(1, 4096)],
            "verify 4 rows x 5 queries": [(5, c) for c in (40, 300, 900, 1600)],
            "prefill 256 + chunk 300@700 + decode": [(256, 256), (300, 700), (1, 1200)]}


# ---- correctness -----------------------------------------------------------------------------
def _checks(dims: Dims, device: str):
    """(name, triton thunk, reference thunk, tolerance) of every kernel; the quantized matmul's
    (name, thunk, check of its result, None)."""
    from kernels.kv_write import write_kv_torch  # noqa: PLC0415
    from kernels.kv_write_triton import write_kv_triton  # noqa: PLC0415
    from kernels.paged_attention import paged_attention_torch  # noqa: PLC0415
    from kernels.paged_attention_triton import paged_attention_triton  # noqa: PLC0415
    from kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch  # noqa: PLC0415
    from kernels.rmsnorm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: PLC0415
    from kernels.rotary import build_cos_sin_cache, rotary_torch  # noqa: PLC0415
    from kernels.rotary_triton import rotary_triton  # noqa: PLC0415

    t = 64 if device == "cuda" else 5
    x, r = (_randn(t, dims.hidden, dims=dims, device=device) for _ in range(2))
    w = _randn(dims.hidden, dims=dims, device=device)
    yield "rms_norm", lambda: rms_norm_triton(x, w, EPS), lambda: rms_norm_torch(x, w, EPS), {}
    yield ("fused_add_rms_norm", lambda: fused_add_rms_norm_triton(x, r, w, EPS),
           lambda: fused_add_rms_norm_torch(x, r, w, EPS), {})
    d = dims.head_dim
    cache = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 4096).to(device)
    q = _randn(t, dims.heads, d, dims=dims, device=device)
    k = _randn(t, dims.kv_heads, d, dims=dims, device=device)
    pos = torch.randint(0, 4096, (t,), device=device)
    yield "rotary", lambda: rotary_triton(q, k, pos, cache), lambda: rotary_torch(q, k, pos, cache), {}
    tri, ref = _write_kv_thunks(k, dims, device, write_kv_triton, write_kv_torch)
    yield "write_kv", tri, ref, {"atol": 0, "rtol": 0}
    for name, rows in _attention_rows(device == "cuda").items():
        args = paged_case(rows, dims, device)
        yield (f"paged_attention {name}", lambda a=args: paged_attention_triton(*a),
               lambda a=args: paged_attention_torch(*a), {"atol": 2e-2, "rtol": 2e-2})
    # fp32 takes other GPU code paths (ieee dots), and a tighter tolerance
    f32 = paged_case([(1, 700), (4, 90), (40, 300)], replace(dims, dtype=torch.float32), device)
    yield ("paged_attention fp32 mixed", lambda: paged_attention_triton(*f32),
           lambda: paged_attention_torch(*f32), {"atol": 1e-4, "rtol": 1e-4})
    yield from quant_checks(dims, device)


def _write_kv_thunks(k, dims: Dims, device: str, triton_fn, torch_fn):
    nb = 2 * k.shape[0] // dims.block_size + 2
    slots = torch.randperm(nb * dims.block_size, device=device)[:k.shape[0]]

    def call(fn):
        kc = torch.zeros(nb, dims.block_size, dims.kv_heads, dims.head_dim, dtype=dims.dtype,
                         device=device)
        vc = torch.zeros_like(kc)
        fn(k, k * 2, kc, vc, slots)
        return kc, vc
    return (lambda: call(triton_fn)), (lambda: call(torch_fn))


def _max_err(got, want) -> float:
    if isinstance(got, tuple):
        return max(_max_err(g, w) for g, w in zip(got, want))
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


def verify(device: str) -> dict:
    """Every kernel against its reference on `device` ("cuda": serving shapes; "cpu": tiny shapes
    in the interpreter, which must come before this process imports triton)."""
    if device != "cuda":
        from kernels import triton_ops  # noqa: PLC0415
        triton_ops.use_interpreter()
    torch.manual_seed(0)
    dims = SERVE if device == "cuda" else TINY
    checks = []
    for name, got_fn, want, tol in _checks(dims, device):
        got = got_fn()
        if tol is None:  # ``want`` checks the result itself: (ok, error / bound), the quantized matmul's
            ok, ratio = want(got)
            checks.append({"kernel": name, "ok": ok, "err_over_bound": ratio,
                           "error": None if ok else f"error {ratio:.3g}x the bound"})
            continue
        want = want()
        try:
            torch.testing.assert_close(got, want, **tol)
            ok, error = True, None
        except AssertionError as e:
            ok, error = False, str(e).splitlines()[0]
        checks.append({"kernel": name, "ok": ok, "max_abs_err": _max_err(got, want), "error": error})
    return {"device": device, "dtype": str(dims.dtype), "ok": all(c["ok"] for c in checks),
            "checks": checks}


def _verify_in_interpreter() -> dict:
    code = "import json; from benches.kernels import verify; print(json.dumps(verify('cpu')))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    if res.returncode != 0:
        return {"device": "cpu", "ok": False, "checks": [], "error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- timing (CUDA) ---------------------------------------------------------------------------
def _sdpa_thunk(args):
    """SDPA on the rows' KV gathered contiguous beforehand (rows must share q_len and ctx_len)."""
    import torch.nn.functional as F  # noqa: PLC0415
    q, kc, vc, tables, _, _, scale, q_lens, ctx_lens = args
    n, L, bs = q_lens[0], ctx_lens[0], kc.shape[1]
    if len(set(q_lens)) != 1 or len(set(ctx_lens)) != 1:
        return None
    slots = (tables[:, torch.arange(L, device=q.device) // bs] * bs
             + torch.arange(L, device=q.device) % bs)  # [R, L]
    k = kc.flatten(0, 1)[slots].transpose(1, 2).contiguous()  # [R, Hkv, L, D]
    v = vc.flatten(0, 1)[slots].transpose(1, 2).contiguous()
    qq = q.view(len(q_lens), n, q.shape[1], q.shape[2]).transpose(1, 2)  # [R, Hq, n, D]
    causal = n == L and n > 1  # a whole prompt; a decode query sees everything
    mask = None
    if 1 < n < L:  # a chunk: its queries sit at the end of the context (SDPA's causal is top-left)
        pos = torch.arange(L, device=q.device)
        mask = pos[None, :] <= pos[L - n:, None]
    return lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=scale, enable_gqa=True)


def _op_cases(dims: Dims):
    """(op, case, triton thunk, torch thunk, sdpa thunk or None, KV bytes read or 0)."""
    from kernels.kv_write import write_kv_torch  # noqa: PLC0415
    from kernels.kv_write_triton import write_kv_triton  # noqa: PLC0415
    from kernels.paged_attention import paged_attention_torch  # noqa: PLC0415
    from kernels.paged_attention_triton import paged_attention_triton  # noqa: PLC0415
    from kernels.rmsnorm import fused_add_rms_norm_torch  # noqa: PLC0415
    from kernels.rmsnorm_triton import fused_add_rms_norm_triton  # noqa: PLC0415
    from kernels.rotary import build_cos_sin_cache, rotary_torch  # noqa: PLC0415
    from kernels.rotary_triton import rotary_triton  # noqa: PLC0415

    for t in (1, 4096):
        x, r = (_randn(t, dims.hidden, dims=dims, device="cuda") for _ in range(2))
        w = _randn(dims.hidden, dims=dims, device="cuda")
        yield ("fused_add_rms_norm", f"{t} tokens", lambda x=x, r=r, w=w: fused_add_rms_norm_triton(x, r, w, EPS),
               lambda x=x, r=r, w=w: fused_add_rms_norm_torch(x, r, w, EPS), None, 0)
    t, d = 4096, dims.head_dim
    cache = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 8192).cuda()
    q = _randn(t, dims.heads, d, dims=dims, device="cuda")
    k = _randn(t, dims.kv_heads, d, dims=dims, device="cuda")
    pos = torch.randint(0, 8192, (t,), device="cuda")
    yield ("rotary", f"{t} tokens", lambda: rotary_triton(q, k, pos, cache),
           lambda: rotary_torch(q, k, pos, cache), None, 0)
    kc = torch.zeros(t // dims.block_size + 1, dims.block_size, dims.kv_heads, d, dtype=dims.dtype,
                     device="cuda")
    vc, slots = torch.zeros_like(kc), torch.randperm(t, device="cuda")
    yield ("write_kv", f"{t} tokens", lambda: write_kv_triton(k, k, kc, vc, slots),
           lambda: write_kv_torch(k, k, kc, vc, slots), None, 0)
    for name, rows in {"decode 1x4096": [(1, 4096)], "decode 32x1024": [(1, 1024)] * 32,
                       "prefill 2048": [(2048, 2048)], "chunk 512@2048": [(512, 2048)]}.items():
        args = paged_case(rows, dims, "cuda")
        kv_bytes = 2 * sum(c for _, c in rows) * dims.kv_heads * d * kc.element_size()
        yield ("paged_attention", name, lambda a=args: paged_attention_triton(*a),
               lambda a=args: paged_attention_torch(*a), _sdpa_thunk(args), kv_bytes)


def time_kernels(timer: Timer) -> list[dict]:
    out = []
    for op, case, tri, ref, sdpa, kv_bytes in _op_cases(SERVE):
        row = {"op": op, "case": case, "triton_ms": timer(tri), "torch_ms": timer(ref)}
        row["speedup_vs_torch"] = row["torch_ms"] / row["triton_ms"]
        if sdpa is not None:
            row["sdpa_ms"] = timer(sdpa)
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
        if kv_bytes:
            row["triton_kv_GBps"] = kv_bytes / row["triton_ms"] / 1e6
        out.append(row)
        print(f"{op:20s} {case:18s} triton {row['triton_ms']:.4f} ms  torch {row['torch_ms']:.4f} ms"
              + (f"  sdpa {row['sdpa_ms']:.4f} ms" if sdpa is not None else ""), flush=True)
    return out


# SmolLM2-135M's linears (q/k/v fused, gate/up fused, the 49152-row head) and the ~1B Llama's.
# ---- the command -----------------------------------------------------------------------------
def _header(cuda: bool) -> dict:
    try:
        import triton  # noqa: PLC0415
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"benchmark": "kernels", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cuda": cuda, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton_version}


def run(args) -> int:
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    result = _header(cuda)
    if result["triton"] is None:
        result["note"] = "triton is not installed: nothing to check"
        ok = False
    elif not cuda:
        result["note"] = ("timings need CUDA; this ran only the correctness pass, on tiny shapes, "
                          "in triton's CPU interpreter")
        print(result["note"], flush=True)
        result["correctness"] = _verify_in_interpreter()
        ok = result["correctness"]["ok"]
    else:
        torch.manual_seed(args.seed)
        result["correctness"] = verify("cuda")
        ok = result["correctness"]["ok"]
        timer = Timer(args.iters)
        result["iters"] = args.iters
        result["kernels"] = time_kernels(timer)
        result["quant_linears"] = time_quant_linears(timer, args.bandwidth)
        result["decode_step"] = time_decode_steps(timer, args.ctx, args.bandwidth)
    _print_checks(result.get("correctness"))
    write_json(args.json, result)
    print(f"wrote {args.json}", flush=True)
    return 0 if ok else 1


def _print_checks(correctness: dict | None) -> None:
    if not correctness:
        return
    for c in correctness["checks"]:
        err = (f"error/bound {c['err_over_bound']:.3g}" if "err_over_bound" in c
               else f"max abs err {c['max_abs_err']:.3g}")
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['kernel']:45s} {err}")
    if correctness.get("error"):
        print(correctness["error"], file=sys.stderr)

