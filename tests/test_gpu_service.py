"""The whole service on a device: Redis, the scheduler, the gateway and one worker
started as `mfs up` starts them (service.launch.Service, the worker given ``--device``), 32 streamed
chat requests across the tiers at once through the official ``openai`` client, every answer equal to
an in-process greedy run (engine.Engine over the same family, device, dtype and weights), and each
request's TTFT and TPOT reported.

On CUDA (``MFS_TEST_GPU=1 TRITON_INTERPRET=0``, what `.ci/gpu OUT service` runs) it serves the default
family; skipped without CUDA. The same body runs on the CPU over a tiny random Llama with the default
family's tokenizer (seconds), so the CUDA test's code runs in every CI. ``MFS_GPU_SERVICE_JSON=PATH``
writes the figures there; ``MFS_GPU_WEIGHTS`` picks the CUDA worker's ``--weights`` (default fp32).
"""
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import openai
import pytest
import torch

from engine import Engine
from engine.prompts import encode_prompt
from service.launch import Service
from worker.family import load_family
from worker.sampling import SamplingParams

CUDA_OK = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
REQUESTS = 32


@dataclass(slots=True)
class Setup:
    """How the service's worker and the in-process reference load the same family."""
    model: str
    tiers: str | None
    dtype: str | None
    device: str
    weights: str
    max_tokens: int
    worker_args: list[str]


@dataclass(slots=True)
class Timing:
    ttft_s: float
    tpot_s: float | None
    tokens: int


def _setup(device: str, tmp_path_factory, frontend) -> Setup:
    if device == "cpu":
        from tests.support.factories import tiny_llama_with_tokenizer
        d = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("gpu-service"), frontend.tokenizer)
        return Setup(str(d), "2,4,6", "float32", "cpu", "fp32", 6,
                     ["--threads", "1", "--num-blocks", "256", "--block-size", "4"])
    weights = os.environ.get("MFS_GPU_WEIGHTS", "fp32")
    return Setup("default", None, None, "cuda", weights, 24, ["--num-blocks", "2048"])


async def _stream(client, model: str, prompt: str, max_tokens: int) -> tuple[str, Timing]:
    t0 = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            if c.delta.content:
                last = time.perf_counter()
                first = first or last
                text += c.delta.content
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return text, Timing(ttft, tpot, tokens)


def _reference(setup: Setup, jobs: list[tuple[str, int]]) -> list[str]:
    fam = load_family(setup.model, tiers=setup.tiers, dtype=setup.dtype, device=setup.device,
                      weights=setup.weights)
    tok = fam.tokenizer
    ids = [encode_prompt(tok, p, chat=True) for p, _ in jobs]
    outs = Engine(fam.model, num_blocks=512).generate(ids, [t for _, t in jobs],
                                                      SamplingParams(max_tokens=setup.max_tokens))
    eos = set(fam.model.cfg.eos_token_ids)
    return [tok.decode([t for t in o if t not in eos], skip_special_tokens=True) for o in outs]


def serve_and_compare(setup: Setup) -> dict:
    """Starts the service on ``setup.device``, sends the 32 streams, compares, returns the figures."""
    jobs = [(f"Write one sentence about the number {i}.", i % 3) for i in range(REQUESTS)]
    with Service(setup.model, tiers=setup.tiers, dtype=setup.dtype, workers=1,
                 worker_args=["--device", setup.device, "--weights", setup.weights, *setup.worker_args]) as svc:
        client = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def run_all():
            ids = sorted([m.id async for m in client.models.list()])
            family = min(ids, key=len)
            names = [f"{family}-small", f"{family}-medium", f"{family}-large"]
            t0 = time.perf_counter()
            got = await asyncio.gather(*(_stream(client, names[t], p, setup.max_tokens) for p, t in jobs))
            return got, time.perf_counter() - t0
        got, wall = asyncio.run(run_all())
    want = _reference(setup, jobs)
    timings = [t for _, t in got]
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    return {"device": setup.device, "model": setup.model, "weights": setup.weights, "requests": REQUESTS,
            "max_tokens": setup.max_tokens, "wall_s": wall,
            "tokens": sum(t.tokens for t in timings),
            "ttft_s": {"median": statistics.median(t.ttft_s for t in timings),
                       "max": max(t.ttft_s for t in timings)},
            "tpot_ms": {"median": 1e3 * statistics.median(tpots), "max": 1e3 * max(tpots)} if tpots else None,
            "mismatches": [{"request": i, "tier": jobs[i][1], "served": g[0], "in_process": w}
                           for i, (g, w) in enumerate(zip(got, want)) if g[0] != w],
            "per_request": [asdict(t) for t in timings]}


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason="needs CUDA "
                                                                     "(MFS_TEST_GPU=1 TRITON_INTERPRET=0)")])])
def test_the_service_on_a_device_answers_32_streams_as_the_engine(device, tmp_path_factory, frontend):
    if device == "cpu" and os.environ.get("MFS_TEST_GPU"):
        pytest.skip("a GPU run takes the cuda case")
    result = serve_and_compare(_setup(device, tmp_path_factory, frontend))
    out = os.environ.get("MFS_GPU_SERVICE_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{device}: {result['requests']} streams, {result['tokens']} tokens in {result['wall_s']:.1f} s; "
          f"TTFT median {result['ttft_s']['median']:.3f} s; TPOT {result['tpot_ms']}")
    assert all(t["tokens"] >= 1 for t in result["per_request"])
    assert not result["mismatches"], result["mismatches"][:3]
