"""Execution paths applied from outside the model (worker/execution.py) and a worker that serves before
its compiled graphs exist (worker/background_compile.py): it serves eagerly while they build, swaps them in
between two steps without recompiling in a client's step, and names the path of every token it sends
(the response's ``mfs.paths``). Two tests compile (one in-process, one through a worker process)."""
import dataclasses
import json
import urllib.request

import pytest

from engine import Engine
from tests.support.wait import wait_for
from worker.execution import EAGER, INDUCTOR, INDUCTOR_TRUNK, choose, compile_decode, compiled_exits, path_name
from worker.background_compile import BackgroundCompile
from worker.family import load_family
from worker.sampling import SamplingParams


def _tokens(eng: Engine, reqs: list[tuple[str, list[int], int]], paths: list[str]) -> dict[str, list[int]]:
    for rid, prompt, tier in reqs:
        eng.add_request(rid, prompt, tier, SamplingParams(max_tokens=6, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        paths.append(path_name(eng.model))
    return out


def test_a_runner_serves_eagerly_while_its_graphs_build_then_swaps_them_in(llama_dir):
    """The build runs on a thread over a shadow of the model and scratch KV pools while the runner keeps
    stepping eagerly (its model untouched); the swap happens between two steps; after it, a family mix
    runs on the compiled path and compiles nothing more; its tokens equal the eager model's here."""
    from torch._dynamo.utils import counters
    model = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="w4a8").model
    eng = Engine(model, block_size=4, num_blocks=64)
    head_kernel = getattr(model.lm_head, "rows_kernel", None)
    bg = BackgroundCompile(eng.runner, INDUCTOR).start()
    paths: list[str] = []  # each step's path, read after it (the swap is applied as a step starts)
    k = 0
    while not bg.done.is_set():  # clients are served while the graphs build
        _tokens(eng, [(f"b{k}", [5, 9, 33, 7][: 2 + k % 3], k % 3)], paths)
        if paths[-1] == EAGER:  # not swapped in yet: the served model is as it was
            assert model.execution is None and getattr(model.lm_head, "rows_kernel", None) is head_kernel
        if paths[-1] == INDUCTOR_TRUNK:  # the trunk's graphs; the exit blocks still eager
            assert compiled_exits(model) == frozenset() and model.execution.exit_graph is not None
        k += 1
        bg.done.wait(0.1)  # a client's pace, not a busy loop: the build needs the cores
    bg.thread.join()
    assert bg.error is None and 0 < bg.first_seconds < bg.seconds
    assert paths[0] == EAGER and set(paths) <= {EAGER, INDUCTOR_TRUNK, INDUCTOR}
    # the trunk's graphs first, then the exit blocks' too: each swap for good, never back
    rank = {EAGER: 0, INDUCTOR_TRUNK: 1, INDUCTOR: 2}
    assert all(rank[a] <= rank[b] for a, b in zip(paths, paths[1:])), paths
    mix = [(f"m{i}", [3 + i, 5, 9, 2, 7][: 2 + i % 4], t) for i, t in enumerate([0, 0, 0, 1, 1, 2])]
    before = counters["stats"]["unique_graphs"]
    after_paths: list[str] = []
    compiled = _tokens(eng, mix, after_paths)
    assert set(after_paths) == {INDUCTOR} and compiled_exits(model) == {0} and counters["stats"]["unique_graphs"] == before
    eager = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="w4a8").model
    assert _tokens(Engine(eager, block_size=4, num_blocks=64), mix, []) == compiled


def test_the_trunk_only_path_keeps_exit_blocks_eager_and_shares_the_graphs(llama_dir):
    """A worker's first swap (inductor-trunk): the segments through the trunk's graph, every exit block
    eager, the exit blocks' own compiled function never called; its tokens are the whole path's for the
    top tier (whose steps run no exit block)."""
    model = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="w4a8").model
    compile_decode(model)
    whole = model.execution
    trunk = whole.trunk_only()
    assert (trunk.name, trunk.exits, trunk.graph) == (INDUCTOR_TRUNK, frozenset(), whole.graph)
    assert whole.name == INDUCTOR and whole.exits == {0} and whole.exit_graph is not None
    calls = {"trunk": 0, "exit": 0}

    def counted(key, f):
        def call(*a, **kw):
            calls[key] += 1
            return f(*a, **kw)
        return call
    trunk.graph = counted("trunk", whole.graph)
    trunk.exit_graph = counted("exit", whole.exit_graph)
    trunk.apply(model)
    paths: list[str] = []
    out = _tokens(Engine(model, block_size=4, num_blocks=64), [("t0", [5, 9, 33, 7], 0), ("t2", [4, 4, 8], 2)], paths)
    assert set(paths) == {INDUCTOR_TRUNK} and calls["trunk"] > 0 and calls["exit"] == 0
    whole.apply(model)
    assert _tokens(Engine(model, block_size=4, num_blocks=64), [("t2", [4, 4, 8], 2)], [])["t2"] == out["t2"]


def test_a_path_changes_nothing_on_the_model_but_its_execution(llama_dir):
    """The background build applies a path to a shadow, a shallow copy of the model
    (worker/background_compile.py): the served model keeps its eager path, its modules and its head; a
    path is refused by a model it was not built for."""
    from worker.background_compile import shadow
    from worker.execution import InductorDecode
    model = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="int8").model
    children = dict(model.named_children())
    sh = shadow(model)
    path = InductorDecode(model)
    path.apply(sh)
    assert sh.execution is path and path_name(sh) == INDUCTOR and sh.lm_head is model.lm_head
    assert model.execution is None and model.head() is model.lm_head and dict(model.named_children()) == children
    assert model.lm_head.rows_kernel is None  # the path runs its own copy of the head where it has a kernel
    other = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="int8").model
    with pytest.raises(ValueError, match="another model"):
        path.apply(other)
    assert other.execution is None


def test_the_path_is_chosen_once_and_a_flag_is_never_ignored(llama_dir):
    """off: eager; on: the compiled path or a refusal where none serves the model; auto: the compiled path
    where one serves, else eager with the reason."""
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    assert choose(model, "off")[0] == EAGER and "--no-compile" in choose(model, "off")[1]
    assert choose(model, "auto")[0] == INDUCTOR and choose(model, "on")[0] == INDUCTOR
    model.ops = dataclasses.replace(model.ops, name="triton")  # the Triton ops on a CPU: no compiled path
    path, why = choose(model, "auto")
    assert path == EAGER and "torch ops on CPU" in why
    with pytest.raises(ValueError, match="torch ops on CPU"):
        choose(model, "on")
    with pytest.raises(ValueError, match="expected one of"):
        choose(model, "yes")
    with pytest.raises(ValueError, match="torch ops on CPU"):
        compile_decode(model)
    assert model.execution is None


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # raises on a status other than 2xx
        return json.loads(r.read())


@pytest.mark.slow  # a worker process compiles its graphs: ~1 min on 2 quiet cores, 4 min on busy ones
def test_a_worker_registers_at_once_and_names_the_path_of_each_answer(family_dir_tok, tmp_path):
    """Through gateway -> Redis -> worker: with --compile auto the worker answers before its graphs
    exist (labelled eager), then, once they are swapped in, labelled inductor; --compile off stays
    eager. Its start line says what it chose and why."""
    from service.launch import Service
    with Service(str(family_dir_tok), tiers="2,4,6", workers=1, dtype="float32", log_dir=str(tmp_path / "on"),
                 worker_args=["--num-blocks", "64", "--block-size", "4", "--weights", "w4a8",
                              "--compile", "auto"]) as svc:
        model = _get(svc.url + "/v1/models")["data"][0]["id"]
        first = _chat(svc.url, model)
        seen = [first["mfs"]["paths"]]
        worker_log = svc.log_dir / "worker-w0.log"

        def compiled() -> bool:  # a client asking every 2 s, until an answer comes from the graphs
            if seen[-1] != [INDUCTOR]:
                seen.append(_chat(svc.url, model)["mfs"]["paths"])
            return seen[-1] == [INDUCTOR]
        wait_for(compiled, 400, lambda: f"a compiled answer: {seen}\n{worker_log.read_text()[-2000:]}", poll=2)
        log = worker_log.read_text()
    assert seen[0][0] == EAGER, seen  # served before the graphs were built
    assert all(p in ([EAGER], [INDUCTOR], [EAGER, INDUCTOR]) for p in seen)
    assert "weights w4a8 (--weights w4a8)" in log and "decode inductor (compiled decode is the default" in log
    with Service(str(family_dir_tok), tiers="2,4,6", workers=1, dtype="float32", log_dir=str(tmp_path / "off"),
                 worker_args=["--num-blocks", "64", "--block-size", "4", "--compile", "off"]) as svc:
        model = _get(svc.url + "/v1/models")["data"][0]["id"]
        assert _chat(svc.url, model)["mfs"]["paths"] == [EAGER]
        log = (svc.log_dir / "worker-w0.log").read_text()
    assert "decode eager (compiled decode off (--compile off" in log and "compiled decode built" not in log


@pytest.fixture(scope="module")
def family_dir_tok(tmp_path_factory, frontend):
    from tests.support.factories import tiny_llama_with_tokenizer
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tinytok"), frontend.tokenizer)


def test_the_build_traces_inductors_fx_toy_under_the_step_lock_and_steps_hold_it(llama_dir, monkeypatch):
    """torch.fx replaces nn.Module.__call__ process-wide while inductor traces its toy function (once a
    process); an eager step on the serving thread then failed ("module is not installed as a
    submodule"). The build traces it first under the runner's step lock, which every step holds."""
    from torch._inductor.loop_body import InterpreterShim
    model = load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model
    eng = Engine(model, block_size=4, num_blocks=64)
    seen: list[bool] = []

    def toy():
        seen.append(eng.runner.step_lock.locked())
        raise RuntimeError("stop the build here")
    monkeypatch.setattr(InterpreterShim, "_dummy_gm", staticmethod(toy))
    bg = BackgroundCompile(eng.runner, INDUCTOR).start()
    bg.thread.join(60)
    assert seen == [True] and "stop the build here" in bg.error and not eng.runner.step_lock.locked()
    forward, held = model.forward_step, []

    def watched(*a, **kw):
        held.append(eng.runner.step_lock.locked())
        return forward(*a, **kw)
    monkeypatch.setattr(model, "forward_step", watched)
    eng.generate([[5, 9, 33]], [2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert held and all(held)
