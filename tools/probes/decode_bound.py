"""What the decode-bound probes share (step_parts.py, ratio_bound.py, nested_prof.py): the default family
and one standalone copy per tier, each quantized alike, the engine they run in, and the workload of
`mfs bench engine --regimes decode` (seed 0). Not a probe itself."""
import argparse

import torch

from mfs.bench_engine import make_workload
from mfs.engine import Engine
from worker.family import add_model_args, load_from_args
from worker.model import standalone_tier
from worker.quant import quantize_model
from worker.sampling import SamplingParams


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
            m.compile_decode()
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
