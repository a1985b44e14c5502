"""The CUDA-only timing code of `mfs bench kernels` (benches/kernels_quant.py, kernels_step.py) run on
the CPU with a stub timer at tiny shapes: the Triton kernels in the interpreter, graphs not captured.
Its figures mean nothing here; what is checked is that the code a rare GPU run depends on runs, builds
the shape it names and counts the bytes it says (a GPU run once lost a step to a NameError)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # triton decides interpreter vs GPU at decoration

import pytest  # noqa: E402

from kernels.common_triton import interpreted  # noqa: E402
from kernels.quant_matmul_triton import _quant_matmul_kernel  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreted(_quant_matmul_kernel), reason="the CPU run of the GPU bench's code")
TINY = dict(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=256)


def once(fn) -> float:
    fn()
    return 1.0


def test_quant_linears_time_every_variant():
    from benches.kernels_quant import time_quant_linears
    rows = time_quant_linears(once, 4.8e12, "cpu", {"tiny": (64, 128)})
    quant = [r for r in rows if r["op"] == "quant_matmul"]
    assert {(r["bits"], r["dtype"], r["batch"]) for r in quant} == {
        (b, d, m) for b in (4, 8) for d in ("bfloat16", "float32") for m in (1, 16)}
    assert {r["bytes"] for r in quant if r["bits"] == 4} == {64 * 64 + 2 * 2 * 64 * 4}  # codes + fp16 s, m
    tiny = [r for r in rows if r["op"] == "tinygemm_int4"]
    assert len(tiny) == 2 and all("error" in r or r["max_rel_err_vs_exact"] < 0.02 for r in tiny)
    assert [r["batch"] for r in rows if r["op"] == "dense_bf16_linear"] == [1, 16]


def test_decode_steps_build_the_shapes_they_name():
    from benches.kernels_step import time_decode_steps
    shapes = {"untied": (TINY, False, 5e5), "tied": (TINY, True, 1e5)}
    res = time_decode_steps(once, 9, 4.8e12, "cpu", shapes)
    assert set(res) == {"untied", "tied"}
    for name, r in res.items():
        assert r["model"] == name and r["int4"]["model"] == name and r["tied_head"] == (name == "tied")
        assert {"torch", "triton", "triton_graphs", "int4"} <= set(r) and r["floor_ms"] > 0
    # a step reads one vocab x hidden matrix whole either way: the tied head (the embedding's tensor,
    # counted once) or the untied head (the embedding only one row, not counted)
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + gate,up,down + 2 norms
    assert res["tied"]["weight_bytes"] == res["untied"]["weight_bytes"] == 2 * (layer + 64 + 256 * 64)
