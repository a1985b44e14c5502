"""``--weights gguf`` (worker/formats/kquant.py): a GGUF whose tensors mix K-quant and legacy block types is
served with each tensor in its own type, the file's blocks kept (no second rounding), and ``--weights
auto`` picks that for such a file; its greedy tokens equal the fp32 path's over the file's dequantized
weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.engines import greedy, make_engine
from tests.support.kquant import mixed_kind, quantize, tiny_kquant_llama


@pytest.fixture(scope="module")
def kq_gguf(tmp_path_factory):
    from kernels import cpu_kquant
    if cpu_kquant.gemv_kernel() is None:
        pytest.skip("our CPU operators need AVX2 and a C++ compiler")
    return tiny_kquant_llama(tmp_path_factory.mktemp("kquant"))


def _gguf_with(path, tensors: dict[str, tuple[np.ndarray, str]]):
    """A GGUF holding only ``tensors`` (name -> (fp32 [N, K], block kind)): what GGUFSource reads."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (v, kind) in tensors.items():
        w.add_tensor(name, quantize(v, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _module_kind(mod) -> str:
    from worker.formats import GGUFBlocksLinear, GGUFEmbedding, Q4A8Linear
    if isinstance(mod, (GGUFBlocksLinear, GGUFEmbedding)):
        return mod.kind
    return "Q4_1" if isinstance(mod, Q4A8Linear) else type(mod).__name__


def test_auto_serves_every_tensor_in_its_own_block_type_bit_for_bit(kq_gguf):
    from worker.family import load_family
    from worker.formats import quantize_model
    fp32 = load_family(str(kq_gguf), tiers="2,4", dtype="float32").model
    model = load_family(str(kq_gguf), tiers="2,4", dtype="float32").model
    report = quantize_model(model, "auto", gguf_path=str(kq_gguf))
    assert report.mode == "gguf" and report.from_float == []
    layers = {f"layers.{i}.{p}": f"blk.{i}.{g}.weight" for i in range(4) for p, g in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))}
    want = {**{k: mixed_kind(g) for k, g in layers.items()}, "embed_tokens": "Q4_K", "lm_head": "Q6_K"}
    assert report.kinds == want  # the report names the block type each tensor kept
    assert {"Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_1"} <= set(want.values())
    for i, layer in enumerate(model.layers):  # gate/up (both Q5_K) fused; q, k (Q4_K) and v (Q6_K) not
        assert _module_kind(layer.gate_up_proj) == "Q5_K" and layer.qkv_proj is None
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"):
            mod, ref = getattr(layer, p), getattr(fp32.layers[i], p).weight
            assert _module_kind(mod) == want[f"layers.{i}.{p}"]
            assert torch.equal(mod.dequantize(), ref)  # the file's values, not rounded again
        gate_up = torch.cat([fp32.layers[i].gate_proj.weight, fp32.layers[i].up_proj.weight])
        assert torch.equal(layer.gate_up_proj.dequantize(), gate_up)
    assert torch.equal(model.lm_head.dequantize(), fp32.lm_head.weight)
    assert torch.equal(model.embed_tokens.dequantize(), fp32.embed_tokens.weight)


def test_auto_on_a_k_quant_gguf_tracks_the_fp32_path_and_batches_exactly(kq_gguf):
    """Served with --weights auto: along the fp32 path's greedy answers (over the file's dequantized
    weights), every position's logits lie within 3 % of their largest magnitude of the fp32 path's (the
    activations are quantized to 8 bits per 32 through 4 layers of a random model: under 2 % seen), and
    wherever the fp32 path's best token leads its second by more than twice that, the served model picks
    it too; its own greedy answers are the same batched and alone, bit for bit."""
    from worker.family import load_family
    fam = load_family(str(kq_gguf), tiers="2,4", dtype="float32", weights="auto")
    ref = load_family(str(kq_gguf), tiers="2,4", dtype="float32", weights="fp32")
    assert fam.model.layers[0].q_proj.name == "gguf-q4_k"
    prompts = [[5, 9, 33, 7], [7, 8, 100, 3, 44], [1, 150, 12]]
    decided, tokens = 0, set()
    for tier in (0, 1):
        got = make_engine(fam).generate(prompts, [tier] * 3, greedy(12))
        assert got == [make_engine(fam).generate([p], [tier], greedy(12))[0] for p in prompts]
        for p, answer in zip(prompts, make_engine(ref).generate(prompts, [tier] * 3, greedy(12))):
            tokens |= set(answer)
            ids = torch.tensor([p + answer])
            with torch.no_grad():
                a = fam.model.logits(fam.model.exit_hidden(ids)[tier][0])
                b = ref.model.logits(ref.model.exit_hidden(ids)[tier][0])
            tol = 0.03 * b.abs().max()
            assert (a - b).abs().max() <= tol
            top2 = b.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > 2 * tol
            assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
            decided += int(clear.sum())
    assert decided >= 30 and len(tokens) > 6  # many clear decisions over varied answers: the check has teeth


def test_auto_keeps_w4a8_where_the_layers_are_q4_1_and_picks_gguf_otherwise(tmp_path, monkeypatch):
    from worker.formats import registry
    monkeypatch.setattr(registry, "auto_choice", lambda device="cpu": "w4a8")
    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    q4_1 = _gguf_with(tmp_path / "a.gguf", {"blk.0.attn_q.weight": (w, "Q4_1"), "token_embd.weight": (w, "Q8_0")})
    q8_0 = _gguf_with(tmp_path / "b.gguf", {"blk.0.attn_q.weight": (w, "Q8_0")})
    assert registry.served("auto", "cpu", str(q4_1)) == "auto"  # then auto's own choice: w4a8 keeps Q4_1
    assert registry.served("auto", "cpu", str(q8_0)) == "gguf"
    assert registry.served("w4a8", "cpu", str(q8_0)) == "w4a8"  # asked for by name: served as asked
    assert registry.served("auto", "cpu", "/some/hf/folder") == "auto"
    assert "the GGUF's own block types" in registry.served_why("auto", "cpu", str(q8_0))
    monkeypatch.setattr(registry, "auto_choice", lambda device="cpu": "fp32")
    assert registry.served("auto", "cuda", str(q8_0)) == "auto"  # where auto serves dense weights


def test_a_tied_head_takes_the_token_embedding_blocks(tmp_path):
    import gguf
    from worker.formats import GGUFSource
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    path = _gguf_with(tmp_path / "t.gguf", {"token_embd.weight": (w, "Q6_K")})
    raw = quantize(w, "Q6_K")
    like = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    kind, perm, blocks = GGUFSource(str(path)).blocks("output.weight", like)
    assert kind == "Q6_K" and torch.equal(perm, torch.arange(48)) and torch.equal(blocks, torch.from_numpy(raw))
    assert GGUFSource(str(path)).blocks("output.weight", like + 1) is None  # values differ: not taken
    assert GGUFSource(str(path)).blocks("output.weight", like, ("Q4_1",)) is None  # a kind the scheme lacks


def test_a_tied_head_and_embedding_hold_one_copy_of_the_files_rows(tmp_path):
    """A tied file (token_embd only, Q6_K): the head and the embedding hold one tensor, the file's rows;
    a lookup is the file's dequantized rows bit for bit, and the KV cache stays fp32."""
    from kernels import cpu_kquant
    from worker.family import load_family
    if cpu_kquant.gemv_kernel() is None:
        pytest.skip("our CPU operators need AVX2 and a C++ compiler")
    path = tiny_kquant_llama(tmp_path, layers=2, tied=True)
    fam = load_family(str(path), tiers="1,2", dtype="float32", weights="gguf")
    ref = load_family(str(path), tiers="1,2", dtype="float32").model
    emb, head = fam.model.embed_tokens, fam.model.lm_head
    assert emb.kind == head.kind == "Q6_K"
    assert emb.blocks.untyped_storage().data_ptr() == head.blocks.untyped_storage().data_ptr()
    ids = torch.tensor([[0, 5, 159, 5], [42, 7, 1, 2]])
    assert torch.equal(emb(ids), ref.embed_tokens.weight[ids])
    assert torch.equal(emb.dequantize(), ref.embed_tokens.weight)
    assert torch.equal(head.dequantize(), ref.lm_head.weight)
    eng = make_engine(fam)
    assert eng.runner.kv.k[0].dtype == torch.float32
    assert len(eng.generate([[5, 9, 33]], [1], greedy(4))[0]) == 4


def test_the_gguf_format_packs_an_hf_model_as_w4a8_does(llama_dir):
    """Without a GGUF (an HF checkpoint) nothing is a file's block: linears as w4a8's Q4_1 from fp32,
    the head as its int8 head, the embedding int8, and the outputs equal w4a8's bit for bit."""
    from worker.family import load_family
    from worker.formats import quantize_model
    a = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    b = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    ra, rb = quantize_model(a, "gguf"), quantize_model(b, "w4a8")
    assert ra.from_gguf == [] and ra.schemes == rb.schemes
    ids = torch.tensor([[3, 17, 41, 9]])
    with torch.no_grad():
        assert torch.equal(a.logits(a.exit_hidden(ids)[-1]), b.logits(b.exit_hidden(ids)[-1]))


@pytest.mark.slow
def test_a_worker_with_auto_weights_serves_a_k_quant_gguf_as_the_offline_engine(kq_gguf):
    """A worker started with --weights auto on the K-quant GGUF registers weights "gguf" (and says why in
    its choice) and answers what the offline engine over the same family answers."""
    from tests.support.pipeline import serve_each_tier
    from worker.family import load_family
    served = serve_each_tier(str(kq_gguf), "2,4", "k", lambda t: [9, 8, 7, 6 + t, 5], dtype="float32",
                             worker_args=("--weights", "auto"))
    prompts, rd = served.prompts, served.reader
    assert served.workers and all(h[b"weights"] == b"gguf" for h in served.workers.values())
    assert all(b"the GGUF's own block types" in h[b"choice"] for h in served.workers.values())
    fam = load_family(str(kq_gguf), tiers="2,4", dtype="float32", weights="auto")
    for rid, (p, t) in prompts.items():
        assert rd.tokens(rid) == make_engine(fam).generate([p], [t], greedy(6))[0]
