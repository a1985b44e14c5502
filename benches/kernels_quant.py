"""`mfs bench kernels`, the quantized matmul: its verification against the exact (fp64) product within
:func:`kernels.quant_matmul.error_bound`, and its timing at serving shapes against dense bf16
``F.linear`` and torch's int4 tinygemm (``aten._weight_int4pack_mm``) on the same weights.

Tinygemm dequantizes ``(q - 8) * scale + zero`` with bf16 scales and zeros: a Q4_1 block ``q d + m``
is ``(q - 8) d + (m + 8 d)``, so it serves the same codes, its scale and zero rounded to bf16 (its
output is compared with the exact product and that error reported, not held to our bound).
"""
from __future__ import annotations

import torch

from benches.kernels_common import Dims, Timer

# SmolLM2-135M's linears (q/k/v fused, gate/up fused, the 49152-row head) and the ~1B Llama's.
QUANT_SHAPES = {"smollm2 qkv": (960, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
                "smollm2 head": (49152, 576), "1b qkv": (3072, 2048), "1b gate_up": (16384, 2048),
                "1b down": (2048, 8192)}


def quant_checks(dims: Dims, device: str):
    """(name, kernel thunk, check of its result, None) of the dequantize-matmul, 4 and 8 bits, fp32 and the bench dtype's
    activations: the check is :func:`within_bound` against the fp64 product (on CUDA at K 2048,
    N 6144 and batches 1, 16, 200: split-K 2, several M tiles; in the interpreter a small shape)."""
    from kernels.quant_matmul import quantize_groups, within_bound  # noqa: PLC0415
    from kernels.quant_matmul_triton import quant_matmul_triton  # noqa: PLC0415
    n, k = (3 * dims.hidden, dims.hidden) if device == "cuda" else (40, 512)
    for bits in (4, 8):
        packed = [t.to(device) for t in quantize_groups(torch.randn(n, k) * 0.02, 32, bits)]
        for m in ((1, 16, 200) if device == "cuda" else (1, 19)):
            for dtype in (torch.float32, dims.dtype):
                x = torch.randn(m, k, device=device).to(dtype)
                yield (f"quant_matmul int{bits} {m}x{k}->{n} {str(dtype)[6:]}",
                       lambda x=x, p=packed, b=bits: quant_matmul_triton(x, *p, 32, b),
                       lambda got, x=x, p=packed, b=bits: within_bound(got.cpu(), x.cpu(), *(t.cpu() for t in p),
                                                                       32, b), None)


def tinygemm_pack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our 4-bit layout -> (tinygemm's packed weight, its [K / group, N, 2] bf16 scales and zeros,
    innerKTiles). Tinygemm wants the even feature in the high nibble; ours holds it in the low one."""
    swapped = ((qweight & 0x0F) << 4) | (qweight >> 4)
    K = qweight.shape[1] * 2
    inner = 8 if K % 256 == 0 else 4 if K % 128 == 0 else 2
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner)
    s, m = scales.float(), mins.float()
    sz = torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz, inner


def tinygemm_thunk(x: torch.Tensor, qweight, scales, mins, group: int):
    """A thunk of torch's int4 tinygemm on our weights (bf16 x), or None where torch lacks it."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return None
    packed, sz, _ = tinygemm_pack(qweight, scales, mins, group)
    xb = x.to(torch.bfloat16)
    return lambda: torch.ops.aten._weight_int4pack_mm(xb, packed, group, sz)


def _row(op: str, case: str, n: int, k: int, m: int, ms: float, nbytes: int, bandwidth: float, **kw) -> dict:
    floor_ms = nbytes / bandwidth * 1e3
    return {"op": op, "case": case, "n": n, "k": k, "batch": m, "ms": ms, "bytes": nbytes,
            "GBps": nbytes / ms / 1e6, "floor_ms": floor_ms, "x_floor": ms / floor_ms, **kw}


def time_quant_linears(timer: Timer, bandwidth: float, device: str = "cuda",
                       shapes: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    """At serving shapes, batch 1 and 16, bf16 activations (and fp32, what the quantized family served
    before): the Triton dequantize-matmul, tinygemm on the same 4-bit codes, and dense bf16
    ``F.linear`` of the same weight, each with the bytes its weight streams and its time against the
    bandwidth floor for them. (``device``/``shapes``: tests run the same code on the CPU, tiny.)"""
    import torch.nn.functional as F  # noqa: PLC0415

    from kernels.quant_matmul import quant_matmul_fp64, quantize_groups  # noqa: PLC0415
    from kernels.quant_matmul_triton import quant_matmul_triton  # noqa: PLC0415
    rows = []
    for name, (n, k) in (shapes or QUANT_SHAPES).items():
        dense = torch.randn(n, k, device=device) * 0.02
        start = len(rows)
        for bits in (4, 8):
            packed = quantize_groups(dense, 32, bits)
            nbytes = sum(t.numel() * t.element_size() for t in packed)
            for m in (1, 16):
                for dtype in (torch.bfloat16, torch.float32):
                    x = torch.randn(m, k, device=device).to(dtype)
                    ms = timer(lambda x=x, p=packed, b=bits: quant_matmul_triton(x, *p, 32, b))
                    rows.append(_row("quant_matmul", f"{name} int{bits} {str(dtype)[6:]} batch {m}", n, k, m,
                                     ms, nbytes, bandwidth, bits=bits, dtype=str(dtype)[6:]))
                if bits == 4:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    rows += _tinygemm_row(timer, name, x, packed, nbytes, bandwidth, quant_matmul_fp64)
        wb = dense.to(torch.bfloat16)
        for m in (1, 16):
            xb = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ms = timer(lambda xb=xb: F.linear(xb, wb))
            rows.append(_row("dense_bf16_linear", f"{name} batch {m}", n, k, m, ms, wb.numel() * 2, bandwidth))
        for r in rows[start:]:
            print(f"{r['op']:18s} {r['case']:34s} " + (f"not run: {r['error']}" if "error" in r else
                  f"{r['ms']:.4f} ms  {r['GBps']:6.0f} GB/s  {r['x_floor']:5.1f}x floor"), flush=True)
    return rows


def _tinygemm_row(timer: Timer, name: str, x, packed, nbytes: int, bandwidth: float, exact_fn) -> list[dict]:
    n, k, m = packed[0].shape[0], x.shape[1], x.shape[0]
    try:
        fn = tinygemm_thunk(x, *packed, 32)
        if fn is None:
            return []
        exact = exact_fn(x.cpu(), *(t.cpu() for t in packed), 32, 4)
        err = float((fn().double().cpu() - exact).abs().max() / exact.abs().max())
        ms = timer(fn)
    except (RuntimeError, NotImplementedError) as e:  # a torch build or GPU without it: say so
        return [{"op": "tinygemm_int4", "case": f"{name} batch {m}", "error": str(e).splitlines()[0]}]
    return [_row("tinygemm_int4", f"{name} bf16 batch {m}", n, k, m, ms, nbytes, bandwidth,
                 max_rel_err_vs_exact=err)]
