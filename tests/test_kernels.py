"""Every Triton kernel against its torch reference, and the engine's greedy tokens with both backends.

Kernels run in triton's CPU interpreter (``TRITON_INTERPRET=1``, set below before any kernel module
is imported) unless the run sets ``TRITON_INTERPRET=0`` on a CUDA machine, where the same tests run
on the GPU. The interpreter cannot do bf16 arithmetic, so there the kernels compute bf16 in fp32;
the cross-compile test and the ``gpu`` test cover the real GPU code paths.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # triton decides interpreter vs GPU at decoration

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import TORCH_OPS, select_backend, triton_ops  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":
    triton_ops.use_interpreter()  # fails clearly if another test module imported triton first

from kernels.common_triton import interpreted  # noqa: E402
from kernels.kv_write import write_kv_torch  # noqa: E402
from kernels.kv_write_triton import write_kv_triton  # noqa: E402
from kernels.paged_attention import paged_attention_torch  # noqa: E402
from kernels.paged_attention_triton import _paged_attention_kernel, paged_attention_triton  # noqa: E402
from kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402
from kernels.rmsnorm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from kernels.rotary import build_cos_sin_cache, rotary_torch  # noqa: E402
from kernels.rotary_triton import rotary_triton  # noqa: E402
from kernels.split_kv_merge_triton import EMPTY_MAX, merge_splits_torch, merge_splits_triton  # noqa: E402

DEVICE = "cpu" if interpreted(_paged_attention_kernel) else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs CUDA", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def attn_tol(dtype: torch.dtype) -> dict:
    # bf16: the two sides round p and the output at different points; 2 bf16 ulps near 1.
    return {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


# ---- RMSNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 48), (2, 3, 40)])
def test_rms_norm(dtype, shape):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype, seed=1)
    torch.testing.assert_close(rms_norm_triton(x, w, EPS), rms_norm_torch(x, w, EPS))


def test_rms_norm_strided_rows_and_promoted_weight():
    big = randn(4, 96)
    x = big[:, :40]  # rows 96 apart: a slice of a wider activation
    w = randn(40, dtype=torch.bfloat16, seed=1)
    out = rms_norm_triton(x, w, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_torch(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    x, r, w = randn(7, 48, dtype=dtype), randn(7, 48, dtype=dtype, seed=1), randn(48, dtype=dtype, seed=2)
    got, want = fused_add_rms_norm_triton(x, r, w, EPS), fused_add_rms_norm_torch(x, r, w, EPS)
    torch.testing.assert_close(got, want)
    assert got[1].data_ptr() not in (x.data_ptr(), r.data_ptr())  # the sum is a new tensor


def test_fused_add_rms_norm_without_residual_returns_x():
    x, w = randn(3, 32), randn(32, seed=1)
    normed, s = fused_add_rms_norm_triton(x, None, w, EPS)
    assert s is x
    torch.testing.assert_close(normed, rms_norm_torch(x, w, EPS))


def test_norm_under_autograd_uses_the_reference():
    x, w = randn(2, 16), randn(16, seed=1).requires_grad_()
    rms_norm_triton(x, w, EPS).sum().backward()
    assert w.grad is not None


# ---- rotary -----------------------------------------------------------------------------------
def _cos_sin(head_dim: int, positions: int = 64) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return build_cos_sin_cache(inv, positions).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3])
def test_rotary(dtype, gqa):
    t, hkv, d = 6, 2, 16
    qkv = randn(t, (gqa + 2) * hkv, d, dtype=dtype)  # q and k as strided views of one projection
    q, k = qkv[:, :gqa * hkv], qkv[:, gqa * hkv:(gqa + 1) * hkv]
    pos = torch.tensor([0, 1, 7, 3, 30, 63], device=DEVICE)
    got, want = rotary_triton(q, k, pos, _cos_sin(d)), rotary_torch(q, k, pos, _cos_sin(d))
    # bf16: the kernel rounds where the reference does, so cancellation leaves no residue.
    tol = {} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(got, want, **tol)


# ---- KV write ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv(cache_dtype):
    k, v = randn(5, 2, 16), randn(5, 2, 16, seed=1)
    slots = torch.tensor([3, 4, 11, 12, 0], device=DEVICE)  # 3|4 and 11|12 cross blocks of 4
    kc = torch.zeros(4, 4, 2, 16, dtype=cache_dtype, device=DEVICE)
    got, want = (kc, kc.clone()), (kc.clone(), kc.clone())
    write_kv_triton(k, v, *got, slots)
    write_kv_torch(k, v, *want, slots)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_write_kv_skips_negative_slots():
    k = randn(2, 1, 16)
    kc, vc = torch.zeros(2, 4, 1, 16, device=DEVICE), torch.zeros(2, 4, 1, 16, device=DEVICE)
    write_kv_triton(k, k, kc, vc, torch.tensor([-1, 5], device=DEVICE))
    assert kc.view(8, 16)[5].equal(k[1, 0]) and kc.view(8, 16).abs().sum(1).count_nonzero() == 1


# ---- paged attention --------------------------------------------------------------------------
def paged_case(rows, hq, hkv, d, block_size, dtype, seed=0):
    """Rows of (q_len, ctx_len) over shuffled pool blocks; returns the op's positional args."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for _, ctx in rows]
    perm = torch.randperm(sum(need) + 2, generator=g)  # spare blocks hold noise never read
    tables = torch.zeros(len(rows), max(need), dtype=torch.long)
    used = 0
    for r, n in enumerate(need):
        tables[r, :n] = perm[used:used + n]
        used += n
    q_lens, ctx_lens = [q for q, _ in rows], [c for _, c in rows]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    kc = randn(len(perm), block_size, hkv, d, dtype=dtype, seed=seed + 1)
    vc = randn(len(perm), block_size, hkv, d, dtype=dtype, seed=seed + 2)
    q = randn(sum(q_lens), hq, d, dtype=dtype, seed=seed + 3)
    return (q, kc, vc, tables.to(DEVICE), starts.to(DEVICE), torch.tensor(ctx_lens, device=DEVICE),
            d ** -0.5, q_lens, ctx_lens)


CASES = {
    # ctx 4 ends on a block boundary of 4, ctx 5 starts a new block, ctx 1 is a first token
    "decode": [(1, 4), (1, 17), (1, 1), (1, 5)],
    "verify": [(3, 9), (4, 4), (2, 8), (1, 6)],
    # a whole prompt, a later chunk reading 21 earlier tokens from the pool, and a decode row
    "prefill": [(20, 20), (12, 33), (1, 7)],
    # more queries than one tile holds (64 // gqa), so a row spans several query tiles
    "long": [(70, 75), (3, 3)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention(case, gqa, dtype):
    args = paged_case(CASES[case], 2 * gqa, 2, 16, 4, dtype)
    torch.testing.assert_close(paged_attention_triton(*args), paged_attention_torch(*args),
                               **attn_tol(dtype))


@pytest.mark.parametrize("case", ["decode", "verify", "prefill", "long"])
def test_paged_attention_split_kv(case):
    # 3 splits of >= 16 keys: some rows get empty splits, some queries see no key in a split,
    # and in "long" each query tile splits its own share of the context.
    args = paged_case(CASES[case], 4, 2, 16, 4, torch.float32, seed=5)
    torch.testing.assert_close(paged_attention_triton(*args, num_splits=3), paged_attention_torch(*args))


def test_paged_attention_odd_shapes_and_no_host_lengths():
    # head dim 24 (padded tile), block size 5, int32 tables, lengths read from the device
    q, kc, vc, bt, qsl, ctx, scale, _, _ = paged_case([(2, 11), (1, 5), (6, 6)], 3, 1, 24, 5,
                                                      torch.bfloat16, seed=7)
    bt, qsl, ctx = bt.int(), qsl.int(), ctx.int()
    torch.testing.assert_close(paged_attention_triton(q, kc, vc, bt, qsl, ctx, scale),
                               paged_attention_torch(q, kc, vc, bt, qsl, ctx, scale),
                               **attn_tol(torch.bfloat16))


def test_merge_splits():
    t, h, s, d = 3, 2, 4, 24
    acc, m, l = randn(t, h, s, d), randn(t, h, s, seed=1) * 4, randn(t, h, s, seed=2).abs()
    m[0, 0, 1:], l[0, 0, 1:] = EMPTY_MAX.value, 0.0  # one (token, head) with three empty splits
    got = merge_splits_triton(acc, m, l, torch.empty(t, h, d, device=DEVICE))
    torch.testing.assert_close(got, merge_splits_torch(acc, m, l, torch.empty(t, h, d, device=DEVICE)))


# ---- wrappers refuse bad calls ----------------------------------------------------------------
def _bad_calls():
    x, w = randn(2, 8), randn(8)
    q, kc, vc, bt, qsl, ctx, scale, ql, cl = paged_case([(1, 3)], 2, 1, 16, 4, torch.float32)
    k = randn(1, 1, 16)
    yield "weight", lambda: rms_norm_triton(x, randn(9), EPS)
    yield "residual", lambda: fused_add_rms_norm_triton(x, randn(2, 8, dtype=torch.bfloat16), w, EPS)
    yield "int", lambda: rms_norm_triton(x.long(), w, EPS)
    yield "unit stride", lambda: rms_norm_triton(randn(8, 2).t(), w, EPS)
    yield "head dim must be even", lambda: rotary_triton(randn(1, 1, 3), randn(1, 1, 3),
                                                         torch.zeros(1, dtype=torch.long, device=DEVICE),
                                                         randn(4, 3))
    yield "positions", lambda: rotary_triton(q, k, torch.zeros(2, dtype=torch.long, device=DEVICE),
                                             _cos_sin(16))
    yield "contiguous", lambda: write_kv_triton(k, k, kc.transpose(0, 1), vc.transpose(0, 1),
                                                torch.zeros(1, dtype=torch.long, device=DEVICE))
    yield "slot_mapping", lambda: write_kv_triton(k, k, kc, vc, torch.zeros(1, device=DEVICE))
    yield "multiple of KV heads", lambda: paged_attention_triton(randn(1, 3, 16), randn(2, 4, 2, 16),
                                                                 randn(2, 4, 2, 16), bt, qsl, ctx, scale)
    yield "q_start_loc", lambda: paged_attention_triton(q, kc, vc, bt, qsl[:1], ctx, scale)
    yield "ctx_lens_host", lambda: paged_attention_triton(q, kc, vc, bt, qsl, ctx, scale, ql, cl + cl)
    yield "different devices", lambda: rms_norm_triton(x, torch.empty(8, device="meta"), EPS)


@pytest.mark.parametrize("message,call", list(_bad_calls()), ids=[m for m, _ in _bad_calls()])
def test_wrappers_reject_bad_calls(message, call):
    with pytest.raises(ValueError, match=message):
        call()


# ---- the backend ------------------------------------------------------------------------------
def test_build_and_select_backend():
    ops = triton_ops.build(TORCH_OPS)
    assert ops.name == "triton" and ops.paged_attention.__wrapped__ is paged_attention_triton
    assert select_backend("triton", DEVICE).name == "triton"


def _tiny_family_dir(directory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    return str(directory)


def test_engine_greedy_tokens_match_torch_ops(tmp_path):
    from worker.family import load_family  # noqa: PLC0415
    from engine import Engine  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    d = _tiny_family_dir(tmp_path)
    outs = {}
    for kernels in ("torch", "triton"):
        fam = load_family(d, tiers="2,4", kernels=kernels, device=DEVICE)
        assert fam.model.ops.name == kernels
        eng = Engine(fam.model, block_size=4, num_blocks=64)
        # two tiers in one batch: a prefill then decode rows crossing block boundaries
        outs[kernels] = eng.generate([[1, 5, 9, 22, 7], [3, 4]], [1, 0],
                                     SamplingParams(max_tokens=6, ignore_eos=True))
    assert outs["triton"] == outs["torch"]


# ---- GPU code paths ---------------------------------------------------------------------------
QUANT_MATMUL_FOR_HOPPER = textwrap.dedent("""
    import os, re, subprocess, tempfile
    import triton
    from kernels.quant_matmul_triton import CANDIDATES, DEFAULT, _quant_matmul_kernel, _split_k_sum_kernel

    def resources(compiled):
        \"\"\"cuobjdump's REG and LOCAL (spilled bytes live in local memory) of the sm_90 cubin.\"\"\"
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"]); f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        return int(re.search(r"REG:(\\d+)", out).group(1)), int(re.search(r"LOCAL:(\\d+)", out).group(1))

    def check_quant_matmul(compile_with_alignment):
        \"\"\"4 and 8 bits, bf16 / fp16 / fp32 x, with and without split-K: tensor-core dots (mma), the
        codes brought in 16 bytes a copy, nothing spilled to local memory.\"\"\"
        P, I = (lambda t: ("*" + t,)), ("i32",)
        aligned = ["X", "Q", "S", "MN", "Y", "WS", "K", "stride_xm", "stride_qn", "stride_ym"]
        # every tile candidate for bf16 int4 (decode's case) without split-K; DEFAULT with split-K for
        # the other activations and code widths (each compile takes seconds: CI's time)
        cases = [("bf16", 4, "u8", cfg, 1) for cfg in CANDIDATES] + [
            (x, bits, q, DEFAULT, 4) for x, bits, q in (("fp16", 4, "u8"), ("fp32", 4, "u8"), ("bf16", 8, "i8"),
                                                        ("fp32", 8, "i8"))]
        for x, bits, q, cfg, split in cases:
            k = compile_with_alignment(
                _quant_matmul_kernel, [P(x), P(q), P("fp16"), P("fp16"), P(x), P("fp32")] + [I] * 7
                + [32, bits, 16, cfg.block_n, split, False], aligned,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            ptx, what = k.asm["ptx"], (x, bits, cfg, split)
            assert "mma.sync" in ptx or "wgmma" in ptx, what
            copies = set(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], (0x[0-9a-f]+)", ptx))
            assert "0x10" in copies, (what, copies)
            regs, local = resources(k)
            assert local == 0 and regs <= 255, (what, regs, local)
        compile_with_alignment(_split_k_sum_kernel, [P("fp32"), P("bf16"), I, I, I, 4, 1024], ["WS", "Y"])
""")

COMPILE_FOR_HOPPER = QUANT_MATMUL_FOR_HOPPER + textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.kv_write_triton import _write_kv_kernel
    from kernels.paged_attention_triton import _paged_attention_kernel
    from kernels.rmsnorm_triton import _rms_norm_kernel
    from kernels.rotary_triton import _rotary_kernel
    from kernels.split_kv_merge_triton import _merge_kernel

    def compile_(kernel, args):
        sig = {n: a[0] if isinstance(a, tuple) else "constexpr" for n, a in zip(kernel.arg_names, args)}
        const = {n: a for n, a in zip(kernel.arg_names, args) if not isinstance(a, tuple)}
        triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32))

    def compile_with_alignment(kernel, args, aligned, **options):
        # as the JIT compiles a launch whose pointers and ``aligned`` ints are multiples of 16
        sig = {n: a[0] if isinstance(a, tuple) else "constexpr" for n, a in zip(kernel.arg_names, args)}
        const = {n: a for n, a in zip(kernel.arg_names, args) if not isinstance(a, tuple)}
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)

    P, I, F = (lambda t: ("*" + t,)), ("i32",), ("fp32",)
    b = P("bf16")
    compile_(_rms_norm_kernel, [b] * 5 + [I] * 5 + [F, True, 2048])
    compile_(_rotary_kernel, [b] * 4 + [P("i64"), P("fp32")] + [I] * 12 + [32, 8, 64])
    compile_(_write_kv_kernel, [b] * 4 + [P("i64")] + [I] * 7 + [8, 64])
    for split, block_m in ((False, 64), (True, 16)):
        acc = P("fp32") if split else None
        compile_(_paged_attention_kernel, [b] * 3 + [P("i64")] * 3 + [acc or b, acc, acc, F]
                 + [I] * 10 + [4, 16, block_m // 4, block_m, 64, 64, split, False])
    compile_(_merge_kernel, [P("fp32")] * 3 + [b] + [I] * 5 + [16, 64])
    check_quant_matmul(compile_with_alignment)
""")


def test_kernels_compile_for_hopper():
    """The interpreter never compiles: build the bf16 GPU variants for sm_90 (no GPU needed)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True,
                         text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu():
    """Each kernel on CUDA at serving shapes against its reference (the bench's verification)."""
    code = "from benches.kernels import verify; import sys; sys.exit(0 if verify('cuda')['ok'] else 1)"
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="0"),
                         capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
