"""The GPU layout of quantized weights (kernels/quant_matmul*.py, worker/formats/groups.py): the Triton
dequantize-matmul against its torch reference, GGUF blocks stored as they ship, and a family quantized
in this layout served by the engine. Kernels run in triton's CPU interpreter unless
``TRITON_INTERPRET=0`` on a CUDA machine."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # triton decides interpreter vs GPU at decoration

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.common_triton import interpreted  # noqa: E402
from kernels.quant_matmul import (dequantize, error_bound, pack_int4,  # noqa: E402
                                  quant_matmul_fp64, quant_matmul_torch, quantize_groups, unpack_int4,
                                  within_bound)
from kernels.quant_matmul_triton import _quant_matmul_kernel, quant_matmul_triton, split_k  # noqa: E402
from worker.formats import GroupQuantLinear  # noqa: E402

DEVICE = "cpu" if interpreted(_quant_matmul_kernel) else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs CUDA", allow_module_level=True)
# The serving-shape cases beyond the first take ~15 s (batch 16, fp32) to ~3 min (batch 200) each in
# the interpreter: run them with MFS_LONG=1 (on CUDA they always run).
LONG = DEVICE == "cuda" or os.environ.get("MFS_LONG") == "1"
long_case = pytest.mark.skipif(not LONG, reason="minutes in the interpreter: MFS_LONG=1 runs it")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 64), generator=_gen())
    p = pack_int4(q)
    assert p.shape == (5, 32) and p.dtype == torch.uint8
    assert torch.equal(p[:, 0], (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8))  # even feature, low nibble
    assert torch.equal(unpack_int4(p).long(), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_groups_stores_what_it_quantized(bits):
    w = torch.randn(24, 96, generator=_gen(1))
    q, s, m = quantize_groups(w, 32, bits)
    assert s.dtype == m.dtype == torch.float16 and s.shape == (24, 3)
    err = (dequantize(q, s, m, 32, bits) - w).abs()
    step = s.float().repeat_interleave(32, dim=1)
    assert (err <= step * 0.5 + 1e-3).all()  # within half a code step (plus fp16 rounding of the min)
    if bits == 8:
        assert not m.any()


def _case(M, N, K, group, bits, dtype, seed, scale=1.0):
    q, s, m = (t.to(DEVICE) for t in quantize_groups(torch.randn(N, K, generator=_gen(seed)) * scale,
                                                       group, bits))
    x = torch.randn(M, K, generator=_gen(seed + 1)).to(dtype).to(DEVICE)
    return x, q, s, m


def _assert_within_bound(y, x, q, s, m, group, bits):
    ok, ratio = within_bound(y.cpu(), x.cpu(), q.cpu(), s.cpu(), m.cpu(), group, bits)
    assert ok, f"error {ratio:.3g}x the bound"


SMALL = [(1, 48, 64, 32), (3, 40, 96, 32), (17, 33, 128, 64), (2, 16, 32, 32), (5, 24, 512, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,N,K,group", [SMALL[0], SMALL[4]] + [
    pytest.param(*c, marks=long_case) for c in SMALL[1:4]])
def test_triton_is_within_the_bound_of_the_exact_product(bits, M, N, K, group, dtype):
    """Against the fp64 product, within the bound of :func:`error_bound`; odd batch and output sizes
    cross the tile edges, and K 512 takes the split-K branch (split_k > 1) where the others do not.
    (Each interpreted call costs ~1 s of CI: the odd shapes run with MFS_LONG=1 and on CUDA.)"""
    x, q, s, m = _case(M, N, K, group, bits, dtype, M)
    y = quant_matmul_triton(x, q, s, m, group, bits)
    assert y.dtype == dtype
    _assert_within_bound(y, x, q, s, m, group, bits)


def test_the_cases_reach_both_split_k_branches():
    assert split_k(48, 64, 32) == 1 and split_k(24, 512, 32) == 2
    assert split_k(6144, 2048, 32) == 2  # the serving-shape cases below
    # the 1B model's shapes: gate_up fills the GPU alone, down (N 2048, K 8192) splits 8 ways
    assert split_k(16384, 2048, 32) == 1 and split_k(2048, 8192, 32) == 8 and split_k(3072, 2048, 32) == 4


def test_the_bound_catches_what_the_old_kernel_did():
    """The bound is tight enough to fail the mistakes it is for: the dequantized weight rounded to
    bf16 before the dot (what the previous kernel did), and a scale taken from the next group."""
    x, q, s, m = _case(16, 64, 2048, 32, 4, torch.bfloat16, 40, scale=0.02)
    xc, qc, sc, mc = x.cpu(), q.cpu(), s.cpu(), m.cpu()
    w = dequantize(qc, sc, mc, 32, 4)
    rounded_tile = (xc.float() @ w.bfloat16().float().t()).bfloat16()
    assert not within_bound(rounded_tile, xc, qc, sc, mc, 32, 4)[0]
    shifted = quant_matmul_torch(xc, qc, torch.roll(sc, 1, dims=1), mc, 32, 4)
    assert not within_bound(shifted, xc, qc, sc, mc, 32, 4)[0]
    exact = quant_matmul_fp64(xc, qc, sc, mc, 32, 4)
    assert within_bound(exact.to(torch.bfloat16), xc, qc, sc, mc, 32, 4)[0]  # the exact value, rounded
    assert (error_bound(xc, qc, sc, mc, 32, 4, torch.float32) < 1e-3 * exact.abs().max()).all()


@pytest.mark.parametrize("M,dtype", [
    (16, torch.bfloat16),
    pytest.param(1, torch.float32, marks=long_case), pytest.param(16, torch.float32, marks=long_case),
    pytest.param(200, torch.bfloat16, marks=long_case), pytest.param(200, torch.float32, marks=long_case)],
    ids=lambda v: str(v))
def test_serving_shape_within_bound_and_rows_independent_of_their_batch(M, dtype):
    """K 2048, N 6144 (the 1B model's q/k/v width x2), int4 groups of 32: the GPU's branches -- 4-bit
    codes unpacked, bf16 x as it is or fp32 x in three pieces, split-K 2 and its ordered sum. The batch
    is within the bound of the exact product, and rows computed alone (batch 1) equal the same rows
    in the batch bit for bit. Only the first case runs in CI on the CPU (~30 s); MFS_LONG=1 runs all."""
    x, q, s, m = _case(M, 6144, 2048, 32, 4, dtype, 30, scale=0.02)
    y = quant_matmul_triton(x, q, s, m, 32, 4)
    _assert_within_bound(y, x, q, s, m, 32, 4)
    for r in sorted({0, M // 2, M - 1}) if DEVICE == "cuda" or M > 16 else [M - 1]:
        alone = quant_matmul_triton(x[r:r + 1], q, s, m, 32, 4)
        assert torch.equal(alone[0], y[r]), f"row {r} alone differs from row {r} in a batch of {M}"


@pytest.mark.parametrize("dtype,bits,K", [(torch.bfloat16, 4, 512), (torch.float32, 8, 96),
                                          pytest.param(torch.float16, 4, 96, marks=long_case),
                                          pytest.param(torch.float32, 4, 512, marks=long_case)], ids=str)
def test_a_row_does_not_depend_on_its_batch(bits, K, dtype):
    """Speculation compares a row computed alone with the same row in a batch: equal bit for bit, in
    the first and last M tiles of a 37-row batch, alone and among 3, with and without split-K."""
    x, q, s, m = _case(37, 40, K, 32, bits, dtype, 2)
    full = quant_matmul_triton(x, q, s, m, 32, bits)
    for r in (0, 34):
        assert torch.equal(quant_matmul_triton(x[r:r + 1], q, s, m, 32, bits)[0], full[r])
        assert torch.equal(quant_matmul_triton(x[r:r + 3], q, s, m, 32, bits)[2], full[r + 2])


def test_leading_dims_and_empty_batches():
    q, s, m = (t.to(DEVICE) for t in quantize_groups(torch.randn(16, 32, generator=_gen(4)), 32, 8))
    x = torch.randn(2, 3, 32, generator=_gen(5)).to(DEVICE)
    y = quant_matmul_triton(x, q, s, m, 32, 8)
    assert y.shape == (2, 3, 16)
    _assert_within_bound(y.reshape(6, 16), x.reshape(6, 32), q, s, m, 32, 8)
    assert quant_matmul_triton(x[:0], q, s, m, 32, 8).shape == (0, 3, 16)


def test_bad_calls_fail_at_the_wrapper():
    q, s, m = quantize_groups(torch.randn(16, 64, generator=_gen(6)), 32, 4)
    q, s, m = q.to(DEVICE), s.to(DEVICE), m.to(DEVICE)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="last dim"):
        quant_matmul_triton(x[:, :32], q, s, m, 32, 4)
    with pytest.raises(ValueError, match="qweight must be"):
        quant_matmul_triton(x, q.to(torch.int8), s, m, 32, 4)
    with pytest.raises(ValueError, match="scales must be float16"):
        quant_matmul_triton(x, q, s.float(), m, 32, 4)
    with pytest.raises(ValueError, match="multiple of the group"):
        quant_matmul_triton(x, q, s, m, 48, 4)
    with pytest.raises(ValueError, match="bits"):
        quant_matmul_triton(x, q, s, m, 32, 3)
    q16, s16, m16 = (t.to(DEVICE) for t in quantize_groups(torch.randn(16, 64, generator=_gen(6)), 16, 4))
    with pytest.raises(ValueError, match="power of two >= 32"):
        quant_matmul_triton(x, q16, s16, m16, 16, 4)


def test_q4_1_blocks_are_stored_as_they_ship():
    """Q4_1's w = d q + m with fp16 d, m: the layout keeps (q, d, m) and dequantizes to the loader's
    fp32 values bit for bit (d q is exact, one rounding for + m)."""
    from worker.formats import dequant_q4_1
    q = torch.randint(0, 16, (32, 64), generator=_gen(7)).to(torch.uint8)
    d = (torch.rand(32, 2, generator=_gen(8)) * 0.01).half().float()
    m = (-torch.rand(32, 2, generator=_gen(9)) * 0.1).half().float()
    lin = GroupQuantLinear.from_q4_1(q, d, m, 32)
    assert torch.equal(lin.dequantize(), dequant_q4_1(q, d, m))
    x = torch.randn(3, 64, generator=_gen(10))
    torch.testing.assert_close(lin.to(DEVICE)(x.to(DEVICE)).cpu(), x @ dequant_q4_1(q, d, m).t(),
                               rtol=1e-5, atol=1e-5)


def test_a_family_in_the_gpu_layout_tracks_fp32_and_serves(llama_dir):
    """layout="groups" (what CUDA gets), int4 (8-bit head: both code widths): every linear becomes a GroupQuantLinear and q/k/v, gate/up fuse
    (rows concatenate); logits track the fp32 model; the engine's greedy tokens with a batch equal
    those of each request alone (the kernel's rows do not depend on their batch)."""
    from engine import Engine
    from worker.family import load_family
    from worker.formats import Int8Embedding, quantize_model
    from worker.sampling import SamplingParams
    ref = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    report = quantize_model(fam, "int4", layout="groups")
    assert report.fused == 12
    lins = [m for m in fam.modules() if isinstance(m, GroupQuantLinear)]
    assert lins and not any(isinstance(m, torch.nn.Linear) for m in fam.modules())
    assert isinstance(fam.embed_tokens, Int8Embedding)
    assert {m.bits for m in lins if m is not fam.lm_head} == {4}
    assert fam.lm_head.bits == 8
    ids = torch.randint(3, 160, (1, 8), generator=_gen(11))
    with torch.inference_mode():
        for a, b in zip(ref.exit_hidden(ids), fam.exit_hidden(ids)):
            la, lb = ref.logits(a), fam.logits(b)
            assert (la - lb).abs().max() < 0.25 * la.abs().max()
    fam.to(DEVICE)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts, tiers = [[5, 9, 33], [7, 8]], [2, 1]
    eng = Engine(fam, max_model_len=64)
    together = eng.generate(prompts, tiers, params)
    alone = [eng.generate([p], [t], params)[0] for p, t in zip(prompts, tiers)]
    assert together == alone and all(len(o) == 3 for o in together)


def test_layout_must_be_known(llama_dir):
    from worker.family import load_family
    from worker.formats import quantize_model
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    with pytest.raises(ValueError, match="layout"):
        quantize_model(fam, "int4", layout="tiles")
