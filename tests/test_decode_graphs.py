"""Decode graphs (worker/decode_graphs.py): the static buffers, buckets and padding against the eager
Triton path.

On CPU the Triton kernels run in the interpreter and the graphs run their body without recording
(``capture=False``): everything but the CUDA recording is checked. On a CUDA machine (``MFS_TEST_GPU=1
TRITON_INTERPRET=0``, as ``bash .ci/gpu OUT kernels`` runs it) the same tests record and replay real
graphs, and ``test_cuda_graphs_record_and_replay`` checks the recording itself.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # triton decides interpreter vs GPU at decoration

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import triton_ops  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":
    triton_ops.use_interpreter()

from kernels.common_triton import interpreted  # noqa: E402
from kernels.paged_attention_triton import _paged_attention_kernel  # noqa: E402
from engine import Engine  # noqa: E402
from worker.decode_graphs import BUCKETS, DecodeGraphs  # noqa: E402
from worker.execution import compile_decode, decode_graphs, use_decode_graphs  # noqa: E402
from worker.family import load_family  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

DEVICE = "cpu" if interpreted(_paged_attention_kernel) else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs CUDA", allow_module_level=True)
CAPTURE = DEVICE == "cuda"

PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [8, 8, 2, 6], [11, 2, 3], [7]]
TIERS = [2, 0, 1, 2, 0]  # decode rows: five through segment 0 (bucket 8), three through 1 (4), two through 2


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    d = tmp_path_factory.mktemp("graphs")  # 4096 positions: on a GPU the long-context graphs split the KV
    LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


def _model(family_dir, max_positions=4096):
    # tiers 0 and 1 with one-layer exit blocks: the graphs' outputs feed eager exit blocks
    return load_family(family_dir, tiers="1+1,2+1,4", kernels="triton", device=DEVICE,
                       max_positions=max_positions).model


def _generate(model, max_tokens=6, block_size=4):
    eng = Engine(model, block_size=block_size, num_blocks=64)
    return eng, eng.generate(PROMPTS, TIERS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_buckets():
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.buckets = BUCKETS
    assert [g.bucket(n) for n in (1, 3, 4, 5, 200, 256)] == [1, 4, 4, 8, 256, 256]
    assert g.bucket(257) is None


@pytest.mark.parametrize("splits", [1, 4])
def test_a_padding_row_attends_to_nothing(splits):
    """What the graphs' padding rows rely on: one query over context 0 reads no key and gets zeros, split
    or not (the graphs plan splits for the longest context), beside real rows that are unaffected."""
    from kernels.paged_attention import paged_attention_torch  # noqa: PLC0415
    from kernels.paged_attention_triton import paged_attention_triton  # noqa: PLC0415
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 16, generator=g).to(DEVICE)
    kc, vc = (torch.randn(6, 4, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    bt = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]], device=DEVICE)
    qsl = torch.arange(4, device=DEVICE)
    ctx = torch.tensor([9, 0, 3], device=DEVICE)  # row 1 is padding
    out = paged_attention_triton(q, kc, vc, bt, qsl, ctx, 0.25, [1, 1, 1], [64, 64, 64], num_splits=splits)
    assert (out[1] == 0).all()
    keep = torch.tensor([0, 2], device=DEVICE)
    ref = paged_attention_torch(q[keep], kc, vc, bt[keep], torch.arange(3, device=DEVICE), ctx[keep], 0.25)
    torch.testing.assert_close(out[keep], ref)


def test_the_path_records_its_graphs_over_each_runners_pools(family_dir, monkeypatch):
    """The CUDA-graphs path owns its recording (the runner imports no graphs): applied before a runner
    exists, it records over the runner's pools when the runner is built; swapped into a runner, over that
    runner's pools at the step that applies it. Recording itself is replaced by a note of the pools."""
    from core.protocol import PlanRow  # noqa: PLC0415
    from worker.execution import CUDA_GRAPHS, CudaGraphDecode, eager, path_name  # noqa: PLC0415
    from worker.runner import ModelRunner  # noqa: PLC0415
    model = _model(family_dir)
    graphs = DecodeGraphs(model, capture=CAPTURE)
    recorded = []
    monkeypatch.setattr(graphs, "capture_all", lambda kv: recorded.append(id(kv)) or 0)
    use_decode_graphs(model, graphs)
    try:
        first = ModelRunner(model, [8] * model.num_segments, 4)
        assert recorded == [id(first.kv)]
        eager(model)
        second = ModelRunner(model, [8] * model.num_segments, 4)
        assert recorded == [id(first.kv)]  # an eager model: nothing to record
        second.swap_in(CudaGraphDecode(graphs))
        second.add("a", SamplingParams(max_tokens=2, ignore_eos=True))
        out = second.execute([PlanRow("a", 2, [1, 2, 3], 0, [[0]] * model.num_segments, True, 0)])
        assert recorded == [id(first.kv), id(second.kv)] and out.path == CUDA_GRAPHS == path_name(model)
    finally:
        use_decode_graphs(model, None)


def test_tokens_logits_and_kv_match_the_eager_step(family_dir):
    """Greedy tokens of a batch of three tiers (decode rows crossing KV blocks, three rows padded to a
    bucket of four) equal the eager Triton path's; the graphs served the decode segments; and the KV
    pools hold the same values afterwards (padding rows wrote nothing)."""
    model = _model(family_dir)
    eager_eng, eager = _generate(model)
    graphs = DecodeGraphs(model, capture=CAPTURE)
    use_decode_graphs(model, graphs)
    try:
        eng, out = _generate(model)
    finally:
        use_decode_graphs(model, None)
    assert out == eager
    # 5 decode steps after the prefill, each with segment 0 (5 rows, then fewer as none finish early:
    # all 5 rows), 1 (3 rows) and 2 (2 rows)
    assert graphs.replays == 5 * 3, graphs.replays
    # recorded when the engine's runner was made: every bucket and context class of every segment
    assert graphs.captured == (3 * len(graphs.buckets) * 2 if CAPTURE else 0)
    for s in range(model.num_segments):
        for a, b in ((eng.kv.k[s], eager_eng.kv.k[s]), (eng.kv.v[s], eager_eng.kv.v[s])):
            used = b.flatten(2).abs().sum(-1) != 0  # [layers, blocks]: blocks the eager run wrote
            torch.testing.assert_close(a.flatten(2)[used], b.flatten(2)[used], atol=1e-4, rtol=1e-4)
            assert (a.flatten(2)[~used] == 0).all(), "a padding row wrote into the pool"


def _decode_step_twice(model, table_blocks=8):
    """Three requests prefilled, then one all-decode step eager and the same step (it rewrites the same
    KV entries) through fresh graphs: (eager logits, graphed logits, the graphs)."""
    from core.protocol import PlanRow  # noqa: PLC0415
    from worker.runner import ModelRunner  # noqa: PLC0415
    runner = ModelRunner(model, [32] * model.num_segments, 4, keep_logits=True)
    rows = []
    for k, (tier, n) in enumerate(((2, 6), (2, 9), (1, 3))):  # prefill three requests
        rid = f"r{k}"
        runner.add(rid, SamplingParams(max_tokens=4, ignore_eos=True))
        table = [list(range(8 * k, 8 * k + table_blocks))] * model.num_segments
        runner.execute([PlanRow(rid, tier, list(range(1, n + 1)), 0, table, True, 0)])
        rows.append(PlanRow(rid, tier, [5 + k], n, table, True, 1))
    eager = runner.execute(rows).logits
    graphs = DecodeGraphs(model, capture=CAPTURE)
    use_decode_graphs(model, graphs)
    try:
        graphed = runner.execute(rows).logits
    finally:
        use_decode_graphs(model, None)
    assert set(graphed) == set(eager) == {"r0", "r1", "r2"}
    return eager, graphed, graphs


def test_step_logits_match(family_dir):
    """One all-decode step's logits through the graphs against the eager step's, same KV state."""
    eager, graphed, graphs = _decode_step_twice(_model(family_dir))
    assert graphs.replays == 3
    for rid in eager:
        torch.testing.assert_close(graphed[rid], eager[rid], atol=1e-4, rtol=1e-4)


def test_a_block_table_wider_than_the_graphs_runs_eagerly(family_dir):
    """Tables of 8 blocks of 4 where the model serves 16 positions (the graphs' tables hold 4 blocks):
    the step runs eagerly, with the same logits."""
    eager, graphed, graphs = _decode_step_twice(_model(family_dir, max_positions=16))
    assert graphs.replays == 0
    for rid in eager:
        assert torch.equal(graphed[rid], eager[rid])


def test_rows_past_the_largest_bucket_run_eagerly(family_dir):
    model = _model(family_dir)
    _, eager = _generate(model, max_tokens=3)
    graphs = DecodeGraphs(model, max_rows=2, capture=CAPTURE)
    assert graphs.buckets == (1, 2)
    use_decode_graphs(model, graphs)
    try:
        _, out = _generate(model, max_tokens=3)
    finally:
        use_decode_graphs(model, None)
    assert out == eager
    assert graphs.replays == 2  # segment 2's two rows in each of the two decode steps; 5 and 3 rows eager


def test_other_pools_drop_the_graphs(family_dir):
    """A second engine (other KV pools) over the same model: the graphs bind to its pools."""
    model = _model(family_dir)
    _, eager = _generate(model, max_tokens=3)
    graphs = DecodeGraphs(model, capture=CAPTURE)
    use_decode_graphs(model, graphs)
    try:
        _, first = _generate(model, max_tokens=3)
        _, second = _generate(model, max_tokens=3)
    finally:
        use_decode_graphs(model, None)
    assert first == second == eager
    assert graphs.replays == 2 * 2 * 3


def test_refusals(family_dir, llama_family):
    with pytest.raises(ValueError, match="triton ops"):
        DecodeGraphs(llama_family.model)
    model = _model(family_dir)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="need the model on CUDA"):
            DecodeGraphs(model, capture=True)
        with pytest.raises(ValueError, match="torch ops on CPU or the triton ops on CUDA"):
            compile_decode(model)
    with pytest.raises(ValueError, match="max_rows"):
        DecodeGraphs(model, max_rows=0)
    with pytest.raises(ValueError, match="another model"):
        use_decode_graphs(_model(family_dir), DecodeGraphs(model, capture=CAPTURE))


@pytest.mark.parametrize("tied", [False, True], ids=["1b-like", "smollm2-like"])
def test_the_kernel_bench_decode_step_runs_graphed(tied):
    """`mfs bench kernels`' decode step (a one-segment random Llama over a random KV pool), at a tiny
    shape, untied (the 1B Llama's) and with the head tied to the embedding (the default family's):
    eager and through the graphs, the same logits; a tied head's bytes count in the floor once. The
    bench itself times it only on CUDA."""
    from kernels import select_backend  # noqa: PLC0415
    from benches.kernels_step import _decode_batch, _floor_bytes, _graphed_step, _random_llama  # noqa: PLC0415
    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=256)
    model = _random_llama(select_backend("triton", DEVICE), DEVICE, shape, tied=tied)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    weights, _ = _floor_bytes(model, 37)
    unique = sum(p.numel() * 2 for p in model.parameters())  # bf16; a tied tensor is listed once
    head = 256 * 64 * 2  # the head's matrix, read whole each step (an embedding's only one row)
    assert weights == (unique if tied else unique - head)
    batch, kv = _decode_batch(model, 37, 4, DEVICE)
    eager = model.forward_step(batch, kv)
    graphed = _graphed_step(model, batch, kv, capture=CAPTURE)()
    use_decode_graphs(model, None)
    assert eager.shape == (1, 256)
    torch.testing.assert_close(graphed.float(), eager.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (MFS_TEST_GPU=1 TRITON_INTERPRET=0)")
def test_cuda_graphs_record_and_replay(family_dir):
    """--compile on CUDA: compile_decode() records graphs, and greedy tokens equal the eager path's."""
    model = _model(family_dir)
    _, eager = _generate(model)
    compile_decode(model)
    try:
        _, out = _generate(model)
        assert decode_graphs(model).captured == 3 * len(decode_graphs(model).buckets) * 2
    finally:
        compile_decode(model, False)
    assert out == eager
