"""`mfs bench peers`' llama.cpp contender: llama-cpp-python on the same GGUF and threads, in its own child."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from benches.peers_common import Spec, perplexity, rss
from worker.memory import release_memory


def run_llama_cpp(spec: Spec) -> dict:
    """Greedy decoding through llama-cpp-python's low-level eval loop, keeping the last position's logits
    only (as serving does). It has no batch of independent sequences: its concurrent run, unless turned
    off, is the requests one after another (reported as such). Resident memory is taken after the timed
    runs, and less what the child held before loading as the model's; the perplexity then needs every
    position's logits, on a second context."""
    import llama_cpp  # noqa: PLC0415
    before = rss()["rss_bytes"]  # the interpreter, numpy and torch (the bench's own): not llama.cpp's
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec.gguf, n_threads=spec.threads, n_ctx=2048, verbose=False)
    load_s = time.perf_counter() - t0
    mem = rss()
    vocab = llm.n_vocab()

    def step(toks: list[int]) -> int:
        llm.eval(toks)
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())

    def one(prompt, new: int) -> tuple[float, float, float]:
        llm.reset()
        t = time.perf_counter()
        toks = list(prompt)
        toks.append(step(toks))
        first = time.perf_counter()
        for _ in range(new - 1):
            toks.append(step(toks[-1:]))
        return t, first, time.perf_counter()

    def measure(prompts):
        t_start = time.perf_counter()
        runs = [one(p, spec.new_tokens) for p in prompts]
        wall = time.perf_counter() - t_start
        tok = spec.new_tokens * len(prompts)
        tpot = sum((e - f) / (spec.new_tokens - 1) for _, f, e in runs) / len(runs)
        return {"requests": len(prompts), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
                "tpot_ms": 1e3 * tpot, "ttft_ms": 1e3 * sum(f - s for s, f, _ in runs) / len(runs),
                "sequential": len(prompts) > 1}

    res = {"name": "llama.cpp (GGUF as shipped)", "load_s": load_s,
           "weights_bytes": Path(spec.gguf).stat().st_size, "single": measure(spec.prompts[:1])}
    if spec.llama_cpp_sequential:
        res["concurrent"] = measure(spec.prompts)
    if spec.long_prompt:
        began, first, _ = one(spec.long_prompt, 1)
        res["long_prompt"] = {"prompt_tokens": len(spec.long_prompt), "ttft_ms": 1e3 * (first - began)}
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(rss())  # resident while serving: every weight page touched by now
    res["model_rss_bytes"] = res["rss_bytes"] - before
    del llm
    release_memory()  # freed memory returned before the contender's memory is read
    full = llama_cpp.Llama(model_path=spec.gguf, n_threads=spec.threads, n_ctx=2048, logits_all=True, verbose=False)

    def logits(ids):
        full.reset()
        full.eval(ids[0].tolist())
        return torch.from_numpy(full.scores[: ids.shape[1]].copy())[None]

    res["ppl_top"] = perplexity(logits, spec.windows)
    return res
