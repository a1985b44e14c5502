"""GGUF's Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks (worker/formats/kquant_blocks.py): dequantized bit for
bit as gguf-py does, and ``mfs::gguf_a8_gemv`` (kernels/cpu_kquant.cpp) against a float64 reference
from the same 8-bit activations, a row's output the same at any batch size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.kquant import quantize, random_rows
from worker.formats.kquant_blocks import BLOCKS, codes, dequantize

KINDS = list(BLOCKS)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_py_bit_for_bit(kind):
    import gguf
    rng = np.random.default_rng(KINDS.index(kind))
    for raw in (random_rows(kind, 24, 512, rng),  # every bit pattern of codes and scales
                quantize(rng.standard_normal((6, 768)).astype(np.float32), kind)):  # real blocks
        ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
        mine = dequantize(torch.from_numpy(raw), kind)
        assert mine.dtype == torch.float32 and torch.equal(mine, ref.reshape(mine.shape))


@pytest.mark.parametrize("kind", KINDS)
def test_codes_give_the_dequantized_weights(kind):
    """``codes``' scale * q - mins is what the operator sums (and the embedding reads): the same fp32 values."""
    raw = torch.from_numpy(random_rows(kind, 8, 256, np.random.default_rng(7)))
    q, scale, mins = codes(raw, kind)
    g = q.shape[1] // scale.shape[1]
    assert g == (16 if kind == "Q6_K" else 32) and (mins is not None) == (kind in ("Q4_K", "Q5_K", "Q5_1"))
    w = scale.view(8, -1, 1) * q.view(8, -1, g).float()
    w = w if mins is None else w - mins.view(8, -1, 1)
    assert torch.equal(w.view(8, -1), dequantize(raw, kind))


def test_rows_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match="multiple of 144"):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="expected one of"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), "IQ4_XS")


@pytest.fixture(scope="module")
def op():
    from kernels import cpu_kquant
    if cpu_kquant.gemv_kernel() is None:
        pytest.skip("our CPU operators need AVX2 and a C++ compiler")
    return torch.ops.mfs.gguf_a8_gemv


# widths: K-quants' super-blocks of 256; the legacy kinds also where K / 32 is not a multiple of 8
# (576: SmolLM2's hidden size, a last group of 2 blocks; 96: a single short group)
WIDTHS = [(k, K) for k in KINDS for K in ((256, 768) if k.endswith("_K") else (576, 96, 512))]


@pytest.mark.parametrize("kind,K", WIDTHS)
def test_operator_matches_the_float64_sum_at_every_batch(op, kind, K):
    """Each row of the operator's output equals the float64 product of the dequantized weights and the
    row's int8-quantized activations within 2e-6 of the sum of |terms| (fp32 scaling of exact integer
    block sums), and equals bit for bit that row computed alone."""
    from kernels.cpu_kquant import kind_id, reference
    from kernels.cpu_gemv import quantize_activations_q8
    rng = np.random.default_rng(K)
    raw = torch.from_numpy(random_rows(kind, 37, K, rng))
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(K))
    y = op(x, raw, kind_id(kind))
    ref = reference(x, *codes(raw, kind))
    xq, dx = quantize_activations_q8(x)
    xd = (xq.double().view(16, -1, 32) * dx.double()[..., None]).view(16, K)
    bound = xd.abs() @ dequantize(raw, kind).double().abs().T  # sum of |terms| per output
    assert (y.double() - ref).abs().le(2e-6 * bound + 1e-30).all()
    for m in (1, 3, 5):  # passes of 4 rows: a full pass, a short one
        assert torch.equal(op(x[:m], raw, kind_id(kind)), y[:m])
    assert torch.equal(op(x[9:10], raw, kind_id(kind))[0], y[9])


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_of_weight_rows_give_every_row_alone_bit_for_bit(op, kind):
    """From 4 activation rows on, whole tiles of 8 weight rows are decoded once for blocks of activation rows
    (kernels/cpu_kquant_tile.cpp; here K 4096: blocks of 32 rows, so 100 rows take four, the last short;
    27 weight rows: three tiles and 3 rows of the row path): each output equals that row computed alone,
    one weight row at a time, bit for bit, at 1, 3, 16 and 100 rows, and the float64 sum within the bound."""
    from kernels.cpu_gemv import quantize_activations_q8
    from kernels.cpu_kquant import kind_id, reference
    K = 4096
    raw = torch.from_numpy(random_rows(kind, 27, K, np.random.default_rng(5)))
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(3))
    y = op(x, raw, kind_id(kind))
    xq, dx = quantize_activations_q8(x)
    xd = (xq.double().view(100, -1, 32) * dx.double()[..., None]).view(100, K)
    bound = xd.abs() @ dequantize(raw, kind).double().abs().T
    assert (y.double() - reference(x, *codes(raw, kind))).abs().le(2e-6 * bound + 1e-30).all()
    alone = torch.cat([op(x[m:m + 1], raw, kind_id(kind)) for m in range(100)])
    assert torch.equal(y, alone)
    for m in (3, 16):
        assert torch.equal(op(x[:m], raw, kind_id(kind)), y[:m])
        assert torch.equal(op(x[-m:], raw, kind_id(kind)), y[-m:])


def test_the_operator_bench_times_each_shape_and_batch(op):
    from benches.linears_gguf import measure
    rows = measure([("tiny", 256, 24, "Q4_K"), ("tiny", 512, 16, "Q6_K")], batches=(1, 5), reps=2, cache_bytes=1 << 16)
    assert [(r["kind"], r["batch"]) for r in rows] == [("Q4_K", 1), ("Q4_K", 5), ("Q6_K", 1), ("Q6_K", 5)]
    assert all(r["ms"] > 0 and r["GMACps"] > 0 for r in rows)
    assert rows[0]["weight_GBps"] * rows[0]["ms"] * 1e6 == pytest.approx(24 * 144)  # the bytes of one copy


def test_operator_checks_its_inputs(op):
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="kind must be 0..6"):
        op(x, torch.zeros(4, 144, dtype=torch.uint8), 9)
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[N, 144\]"):
        op(x, torch.zeros(4, 140, dtype=torch.uint8), 3)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):
        op(torch.randn(2, 96), torch.zeros(4, 54, dtype=torch.uint8), 3)


@pytest.mark.slow  # a compile of the operator where the cache lacks one: ~20 CPU-s, most of it torch's headers
def test_the_avx512_vnni_build_compiles_here_too():
    """Where the CPU lacks AVX-512 VNNI its path cannot run here, but it must compile (g++ accepts the
    flags on any x86 host): kernels/cpu_gemv.py's build of these sources for that target. Its cache keys
    the library on the sources' and headers' text, the compiler and its flags, so a changed source is
    built again."""
    import shutil

    from kernels import cpu_gemv, cpu_kquant
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    assert cpu_gemv.build(cpu_kquant.SOURCES, target="avx512-vnni").stat().st_size > 0
