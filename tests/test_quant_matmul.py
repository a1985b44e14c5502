"""The GPU layout of quantized weights (kernels/quant_matmul*.py, worker/formats/groups.py): the Triton
dequantize-matmul against its torch reference, GGUF blocks stored as they ship, and a family quantized
in this layout served by the engine. Kernels run in triton's CPU interpreter unless
``TRITON_INTERPRET=0`` on a CUDA machine."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # triton decides interpreter vs GPU at decoration

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.common_triton import interpreted  # noqa: E402
from kernels.quant_matmul import (dequantize, pack_int4, quant_matmul_torch,  # noqa: E402
                                  quantize_groups, unpack_int4)
from kernels.quant_matmul_triton import _quant_matmul_kernel, quant_matmul_triton  # noqa: E402
from worker.formats import GroupQuantLinear  # noqa: E402

DEVICE = "cpu" if interpreted(_quant_matmul_kernel) else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs CUDA", allow_module_level=True)


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


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,N,K,group", [(1, 48, 64, 32), (3, 40, 96, 32), (17, 33, 128, 64), (2, 16, 32, 32)])
def test_triton_matches_the_reference(bits, M, N, K, group):
    """Odd batch and output sizes cross the tile edges (the interpreter's tiles are 16 x 16 x 32)."""
    q, s, m = (t.to(DEVICE) for t in quantize_groups(torch.randn(N, K, generator=_gen(M)), group, bits))
    x = torch.randn(M, K, generator=_gen(M + 1)).to(DEVICE)
    torch.testing.assert_close(quant_matmul_triton(x, q, s, m, group, bits),
                               quant_matmul_torch(x, q, s, m, group, bits), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_batch():
    """Speculation compares a row computed alone with the same row in a batch: equal bit for bit."""
    q, s, m = (t.to(DEVICE) for t in quantize_groups(torch.randn(40, 96, generator=_gen(2)), 32, 4))
    x = torch.randn(19, 96, generator=_gen(3)).to(DEVICE)
    full = quant_matmul_triton(x, q, s, m, 32, 4)
    for r in (0, 7, 18):
        assert torch.equal(quant_matmul_triton(x[r:r + 1], q, s, m, 32, 4)[0], full[r])


def test_leading_dims_and_empty_batches():
    q, s, m = (t.to(DEVICE) for t in quantize_groups(torch.randn(16, 32, generator=_gen(4)), 32, 8))
    x = torch.randn(2, 3, 32, generator=_gen(5)).to(DEVICE)
    y = quant_matmul_triton(x, q, s, m, 32, 8)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y, quant_matmul_torch(x, q, s, m, 32, 8), rtol=1e-5, atol=1e-5)
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
