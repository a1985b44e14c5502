"""What the probes of the compiled decode step share (not a probe itself): the default family, nested and as
one standalone copy per tier, quantized alike and compiled as `mfs bench engine --compile` does; the engine
they run in; the workload of `mfs bench engine --regimes decode` (seed 0); an engine started on given tiers;
a step's median; and a hook that times every compiled graph call."""
import argparse
import statistics
import time
from typing import Callable

import torch

from benches.engine import make_workload
from engine import Engine
from worker.execution import compile_decode
from worker.family import add_model_args, load_from_args
from worker.model import standalone_tier
from worker.formats import quantize_model
from worker.sampling import SamplingParams


def compiled_nested(weights: str = "w4a8"):
    """The nested default family in ``weights`` (quantized at load), compiled and warmed up; two threads."""
    torch.set_num_threads(2)
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    model = load_from_args(ap.parse_args(["--model", "default-raw", "--weights", weights])).model
    compile_decode(model)
    engine(model).runner.warm_up()
    return model


def nested_and_tiers(weights: str, compile: bool):
    """(model, [standalone tier k]) of the default family in ``weights``, two threads; with ``compile``
    each compiled and warmed up as `mfs bench engine --compile` does."""
    torch.set_num_threads(2)
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    fam = load_from_args(ap.parse_args(["--model", "default-raw"]))
    model = fam.model
    copies = [standalone_tier(model, k) for k in range(len(model.tiers))]
    for m in [model, *copies]:
        quantize_model(m, weights, gguf_path=fam.base.source, device="cpu", load_tokenizer=lambda: fam.tokenizer)
        if compile:
            compile_decode(m)
            engine(m).runner.warm_up()
    return model, copies


def engine(m) -> Engine:
    return Engine(m, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)


def workload(model):
    """6 requests spread over the tiers (seed 0), 16-32-token prompts, 96 tokens each."""
    n = len(model.tiers)
    return make_workload(6, n, [1.0] * n, (16, 32), (96, 96), model.cfg.vocab_size, 0)


def started(m, items) -> Engine:
    """An engine on ``m`` serving ``items`` (each at its tier, or tier 0 of a standalone copy), five steps in."""
    eng = engine(m)
    for it in items:
        eng.add_request(it.rid, it.prompt, 0 if len(m.tiers) == 1 else it.tier,
                        SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        eng.step()
    return eng


def started_tiers(m, tiers: list[int], prompt_len: int = 40, max_tokens: int = 200) -> Engine:
    """An engine on ``m`` with one request a tier in ``tiers`` (prompt_len-token prompts), five steps in."""
    eng = engine(m)
    for i, t in enumerate(tiers):
        eng.add_request(f"r{i}", [100 + 7 * i + j for j in range(prompt_len)], t,
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(5):
        eng.step()
    return eng


def median_step_ms(eng: Engine, steps: int) -> float:
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def time_graph_calls(m, record: Callable[[int, int, float], None]) -> None:
    """Every compiled graph call of ``m`` (after compile_decode; the segments' and the exit blocks')
    reported as record(layers, rows, seconds)."""
    def timed(f):
        def call(layers, h, *a):
            t = time.perf_counter()
            out = f(layers, h, *a)
            record(len(layers), h.shape[0], time.perf_counter() - t)
            return out
        return call
    m.execution.graph = timed(m.execution.graph)
    if m.execution.exit_graph is not None:
        m.execution.exit_graph = timed(m.execution.exit_graph)
