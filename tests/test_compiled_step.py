"""The opt-in compiled decode segment (worker/compiled_step.py, ``compile_decode``): the same logits as
the eager ops within fp32 rounding, every step of a mixed-tier run, exit blocks included; mixed steps
stay eager; and the KV it writes is the eager path's. The compiled int8 head (fp32, batch-invariant), and the warm-up a
``--compile`` worker runs before it registers."""
import dataclasses

import pytest
import torch

from engine import Engine
from worker.execution import compile_decode, compiled_exits
from worker.family import load_family
from worker.sampling import SamplingParams


def _run(model, n=6):
    """Four requests of three tiers; the tier-0 one stops early, so later steps have exit blocks whose
    rows all go on (the block writes its KV alone) besides ones where a row leaves."""
    eng = Engine(model, block_size=4, num_blocks=64, keep_logits=True)
    prompts = [([5, 9, 33, 7, 2], 2, n), ([7, 8], 0, 2), ([4, 4, 4, 4, 4, 4, 4], 1, n), ([11, 12, 13], 2, n)]
    for i, (p, t, m) in enumerate(prompts):
        eng.add_request(f"r{i}", p, t, SamplingParams(max_tokens=m, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        steps.append({o.request_id: (list(o.new_token_ids), o.logits) for o in eng.step()})
    return steps, eng


@pytest.mark.parametrize("weights,attention", [("fp32", "ours"), ("int8", "ours"), ("w4a8", "ours"),
                                               ("fp32", "gather + sdpa")])
def test_compiled_decode_matches_eager(llama_dir, weights, attention, monkeypatch):
    """Attention "ours": mfs::decode_attention where it builds (kernels/cpu_attention.py); "gather + sdpa":
    the graph's own gather and SDPA, as where it does not."""
    import worker.compiled_step
    if attention == "ours":
        assert worker.compiled_step.decode_attention_kernel() is not None  # head_dim 16: its AVX2 form
    else:
        monkeypatch.setattr(worker.compiled_step, "decode_attention_kernel", lambda: None)
    eager = load_family(str(llama_dir), tiers="2+2,4+1,6", dtype="float32", weights=weights).model
    comp = load_family(str(llama_dir), tiers="2+2,4+1,6", dtype="float32", weights=weights).model
    compile_decode(comp)
    if weights == "int8" and comp.execution.head_kernel is not None:
        # an AVX-512 CPU's compiled head computes in fp32: the eager run gets the same sum uncompiled
        from worker.compiled_step import int8_rows
        eager.lm_head.rows_kernel = int8_rows
    calls = {"n": 0, "exit": 0}
    exit_layers = {id(layer) for blk in comp.exit_blocks.values() for layer in blk}
    assert compiled_exits(comp) == {0, 1}  # both blocks are built as the trunk's layers

    def counting(inner, exit_graph):
        def call(layers, *a, **kw):
            assert exit_graph == all(id(layer) in exit_layers for layer in layers)  # each through its own
            calls["n"] += 1
            calls["exit"] += exit_graph
            return inner(layers, *a, **kw)
        return call
    comp.execution.graph = counting(comp.execution.graph, False)
    comp.execution.exit_graph = counting(comp.execution.exit_graph, True)
    a, eng_a = _run(eager)
    b, eng_b = _run(comp)
    assert len(a) == len(b)
    compared = 0
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for rid in sa:
            (ta, la), (tb, lb) = sa[rid], sb[rid]
            if la is not None:
                torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
                compared += 1
            assert ta == tb
    assert compared >= 20 and calls["n"] >= 3 * 4  # all-decode steps went through the graph, per segment
    assert calls["exit"] >= 2  # and the exit blocks of decode steps where their tier's rows sample
    for s in range(3):  # the pools hold the same K/V (trunk, and exit blocks whose rows go on or leave)
        torch.testing.assert_close(eng_b.kv.k[s], eng_a.kv.k[s], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eng_b.kv.v[s], eng_a.kv.v[s], rtol=1e-5, atol=1e-5)


def test_compile_is_refused_off_the_torch_cpu_path(llama_dir):
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    model.ops = dataclasses.replace(model.ops, name="triton")
    with pytest.raises(ValueError, match="torch ops on CPU"):
        compile_decode(model)


def test_layers_of_different_structure_are_refused(llama_dir):
    from torch import nn
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    model.layers[3].mlp_extra = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="one structure"):
        compile_decode(model)


def test_an_exit_block_built_unlike_the_trunk_stays_eager(llama_dir):
    """The graph skips its guards on the layers' modules, so only blocks whose layers have the trunk's
    signature may run through it; another block keeps the eager layers, and its tier still serves."""
    from torch import nn
    model = load_family(str(llama_dir), tiers="2+2,4+1,6", dtype="float32").model
    model.exit_blocks["0"][1].mlp_extra = nn.Linear(4, 4)
    compile_decode(model)
    assert compiled_exits(model) == {1}
    eng = Engine(model, block_size=4, num_blocks=64)
    out = eng.generate([[5, 9, 33, 7, 2], [7, 8, 9]], [0, 1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o) for o in out] == [4, 4]
    compile_decode(model, False)
    assert compiled_exits(model) == frozenset()


def test_the_compiled_int8_head_is_fp32_exact_and_batch_invariant(llama_dir):
    """The compiled int8 head kernel computes in fp32 (torch's int8 kernel rounds activations to bf16):
    close to the dequantized weights' fp32 product, and each row's logits the same bit for bit whatever
    the batch; the model's own head keeps its default kernel under the compiled path, which runs a copy of
    the head on the compiled kernel (worker/execution.py). Checked on every CPU, whichever kernel
    compile_decode would pick on this one."""
    import copy
    from worker.compiled_step import compiled_int8_rows
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32", weights="int8").model
    head = model.lm_head
    x = torch.randn(7, head.in_features, generator=torch.Generator().manual_seed(3))
    want = x.double() @ head.dequantize().double().t()
    with torch.inference_mode():
        bf16 = torch._weight_int8pack_mm(x.to(torch.bfloat16), head.qweight, head.scales).float()
        default = head(x)
        compile_decode(model)
        fp32 = copy.copy(head)  # the head on the compiled kernel, as the inductor path holds one on AVX-512
        fp32.rows_kernel = compiled_int8_rows()
        got = fp32(x)
        singles = torch.cat([fp32(x[i:i + 1]) for i in range(7)])
        pairs = torch.cat([fp32(x[i:i + 2]) for i in range(0, 6, 2)])
        under_path = head(x)
        compile_decode(model, False)
    assert (got.double() - want).abs().max() < 1e-5 < (bf16.double() - want).abs().max()
    assert torch.equal(singles, got) and torch.equal(pairs, got[:6])
    assert head.rows_kernel is None and torch.equal(under_path, default)


@pytest.mark.parametrize("capability,ours", [("AVX512", True), ("AVX512", False), ("AVX2", True),
                                             ("AVX2", False), ("DEFAULT", False)])
def test_compile_takes_the_fp32_head_only_on_avx512_without_our_operator(llama_dir, monkeypatch, capability,
                                                                          ours):
    """Our int8 operator (kernels/cpu_gemv.py) beat inductor's compiled head at every batch on the
    AVX-512 machine, and with AVX2 inductor's int8 loop runs 4x-18x slower than the bf16 kernel
    (compiled_step's docstring): so compile_decode leaves the head on the int8 linears' own kernel
    except on an AVX-512 CPU where our operator does not serve."""
    from kernels import cpu_gemv
    from worker.compiled_step import compiled_int8_rows
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32", weights="int8").model
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_gemv, "_choice", [torch.ops.mfs.int8_gemv if ours else None])
    compile_decode(model)
    want = compiled_int8_rows() if capability == "AVX512" and not ours else None
    path = model.execution
    assert path.head_kernel is want and model.lm_head.rows_kernel is None  # the model's own head: untouched
    assert (path.head(model) is model.lm_head) if want is None else (path.head(model).rows_kernel is want)


def test_compile_leaves_a_tiled_w4a8_head_on_its_own_operator(llama_dir, monkeypatch):
    """Where compile_decode would hand an int8 head inductor's fp32 rows (AVX-512 without our int8
    operator, e.g. MFS_CPU_GEMV=0), a tiled w4a8 head keeps mfs::int8_a8_tile_gemv and still runs."""
    from kernels import cpu_gemv
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32", weights="w4a8").model
    assert model.lm_head.tiled
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_gemv, "_choice", [None])
    compile_decode(model)
    assert model.execution.head_kernel is None and model.head() is model.lm_head
    x = torch.randn(2, model.lm_head.in_features)
    assert model.head()(x).shape == (2, model.lm_head.out_features)


def test_a_warmed_up_runner_serves_without_compiling_and_its_blocks_leak_nothing(llama_dir):
    """``python -m worker --compile`` builds the graphs with ModelRunner.warm_up before registering:
    afterwards requests of other lengths, batch sizes and tiers compile nothing, and the blocks the
    warm-up wrote change no request's tokens (the eager model, its head computing the same fp32 sum
    uncompiled, gives the same)."""
    from torch._dynamo.utils import counters
    from worker.compiled_step import int8_rows
    work = [([5, 9, 33, 7, 2] * 5, 2), ([7, 8], 0), ([4] * 13, 1), ([11, 12, 13], 2), ([3, 1, 4, 1, 5, 9, 2], 2)]

    def serve(model, warm: bool):
        eng = Engine(model, block_size=4, num_blocks=64)
        graphs = [counters["stats"]["unique_graphs"]]
        if warm:
            assert eng.runner.warm_up() > 0 and not eng.runner.requests  # its requests are gone
            graphs.append(counters["stats"]["unique_graphs"])
        for i, (p, t) in enumerate(work):
            eng.add_request(f"r{i}", p, t, SamplingParams(max_tokens=9, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, graphs + [counters["stats"]["unique_graphs"]]

    comp = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="int8").model
    compile_decode(comp)
    eager = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="int8").model
    if comp.execution.head_kernel is not None:  # AVX-512: the compiled head's fp32 sum, uncompiled
        eager.lm_head.rows_kernel = int8_rows
    warmed, (before, after_warm_up, after_serving) = serve(comp, True)
    want, _ = serve(eager, False)
    assert after_warm_up > before and after_serving == after_warm_up  # built by the warm-up, then none
    assert warmed == want and all(len(v) == 9 for v in warmed.values())


def test_after_the_warm_up_a_family_mix_compiles_nothing(llama_dir):
    """A family mix (many small, some medium, few large requests in the same steps) sends the exit
    blocks rows that are the tail of their segment, with positions of their own -- inputs made
    otherwise than the warm-up's, where each tier ran alone: none of it may recompile in a client's
    step (it once cost the first mixed step ~3 s)."""
    from torch._dynamo.utils import counters
    model = load_family(str(llama_dir), tiers="2+2,4+1,6", dtype="float32", weights="w4a8").model
    compile_decode(model)
    eng = Engine(model, block_size=4, num_blocks=128)
    assert eng.runner.warm_up() > 0
    before = counters["stats"]["unique_graphs"]
    tiers = [0] * 5 + [1] * 3 + [2] * 2
    for i, t in enumerate(tiers):
        eng.add_request(f"m{i}", [3 + i, 5, 9, 2, 7][: 2 + i % 4], t, SamplingParams(max_tokens=5, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps >= 5 and counters["stats"]["unique_graphs"] == before


def test_a_standalone_tier_worker_warms_up_under_its_global_tier(llama_dir):
    """The independent layout's worker holds one tier as its own one-segment model and is planned in
    global tiers (``tier_map``): its warm-up plans the global number (here 2 for local 0; a 2-layer
    tier, so the graph is the other tests' and compiles from inductor's cache) and builds that model's
    graphs."""
    from torch._dynamo.utils import counters
    from worker.model import standalone_tier
    from worker.runner import ModelRunner
    model = standalone_tier(load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model, 0)
    compile_decode(model)
    runner = ModelRunner(model, [16], 4, tier_map={2: 0})
    before = counters["stats"]["unique_graphs"]
    assert runner.warm_up() > 0 and not runner.requests
    assert counters["stats"]["unique_graphs"] > before
    with pytest.raises(ValueError, match="no global tier maps to this model's top tier"):
        ModelRunner(model, [16], 4, tier_map={2: 1}).warm_up()


@pytest.mark.parametrize("width_one", [False, True])
def test_the_graphs_context_slots_are_the_eager_gathers(width_one):
    """decode_slots (the compiled segment's own) gives the slots, mask and last positions the eager
    decode_gather gives, for rows of different lengths over scattered blocks, and for a table one block
    wide given its column twice (as NestedModel._compiled_layers passes it)."""
    from kernels.paged_attention import decode_gather
    from worker.compiled_step import decode_slots
    g = torch.Generator().manual_seed(0)
    bs = 4
    if width_one:
        lens = torch.tensor([1, 3, 4])
        tables = torch.randperm(50, generator=g)[:3].view(3, 1)
    else:
        lens = torch.tensor([9, 2, 17, 5])
        tables = torch.randperm(50, generator=g)[:20].view(4, 5)
    flat, mask, _, lmax, _ = decode_gather(tables, lens, list(range(len(lens))), list(range(len(lens))),
                                           lens.tolist(), bs)
    given = tables.expand(-1, 2).contiguous() if width_one else tables
    f2, m2, last = decode_slots(given, lens, int(lens.max()), bs)
    assert lmax == int(lens.max())
    assert torch.equal(f2, flat) and torch.equal(m2, mask) and torch.equal(last, lens - 1)
    assert f2.view(len(lens), lmax)[0, :int(lens[0])].tolist() == [
        int(tables[0, p // bs]) * bs + p % bs for p in range(int(lens[0]))]
