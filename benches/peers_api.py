"""`mfs bench peers`' contender "api": what `make up` serves, measured the way a user meets it.

It starts the real `mfs up --model M` (the defaults are the product; ``--up-args`` adds flags), waits
for its "serving at" line, and sends through HTTP what the in-process contenders run: one streamed
greedy request on the top tier, then the concurrent family mix; the top tier's perplexity comes from
the served logprobs (``echo`` + ``logprobs``, ``max_tokens`` 0) over the same held-out windows; with
``--long-prompt``, the first token of one long prompt. Resident memory: every process `mfs up` started,
and its workers' apart. Every request goes gateway -> Redis -> scheduler -> worker, as in production.
It also times the start: seconds from launching `mfs up` to its first served token, and records the
``mfs`` field of each answer (the tiers, and the execution path where the worker names it).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benches.lib import model_ids

SERVING = re.compile(r"serving at (http://\S+?)/v1")


def start_mfs_up(model: str, start_timeout_s: float, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, Path, float]:
    """``mfs up --model MODEL --port 0 [EXTRA]`` as a child; returns it, its URL, its log and the launch time."""
    log = Path(tempfile.mkdtemp(prefix="mfs-peers-api-")) / "mfs-up.log"
    launched = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mfs.cli", "up", "--model", model, "--port", "0", *extra],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = launched + start_timeout_s
    while time.perf_counter() < deadline:
        m = SERVING.search(log.read_text())
        if m:
            return proc, m.group(1), log, launched
        if proc.poll() is not None:
            raise RuntimeError(f"mfs up exited with {proc.returncode} before serving:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    stop_mfs_up(proc)
    raise RuntimeError(f"mfs up did not serve within {start_timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


def tree_rss_bytes(root: int) -> dict[str, int]:
    """Resident memory of ``root`` (`mfs up`) and every process below it, by what each runs: ``worker``,
    ``scheduler``, ``gateway`` (``python -m ROLE``), ``redis`` and ``other`` (`mfs up` itself). The
    children start in sessions of their own, so they are found by parent, not by process group."""
    page = os.sysconf("SC_PAGE_SIZE")
    procs: dict[int, tuple[int, int]] = {}  # pid -> (ppid, rss bytes)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            procs[int(stat.parent.name)] = (int(fields[1]), int(fields[21]) * page)  # ppid; rss in pages
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    out: dict[str, int] = {}
    for pid, (_, rss) in procs.items():
        up, seen = pid, 0
        while up not in (root, 0, 1) and up in procs and seen < 64:
            up, seen = procs[up][0], seen + 1
        if up != root:
            continue
        out[_role(pid)] = out.get(_role(pid), 0) + rss
    return out


def _role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    for a, b in zip(argv, argv[1:]):
        if a == b"-m" and b.decode() in ("worker", "scheduler", "gateway"):
            return b.decode()
    return "redis" if any(b"redis" in a for a in argv[:1]) else "other"


def stop_mfs_up(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # mfs up stops its processes on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def stream_one(session, url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed greedy completion of exactly ``new_tokens`` tokens: its stamps and ``mfs`` field."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, stamps, served, usage = time.perf_counter(), [], None, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            ch = json.loads(line[6:])
            if ch.get("choices") and ch["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
            served = ch.get("mfs", served)
            usage = ch.get("usage") or usage
    tokens = (usage or {}).get("completion_tokens", len(stamps))
    if tokens != new_tokens:
        raise RuntimeError(f"{model}: {tokens} tokens served, {new_tokens} asked")
    return {"start": start, "first": stamps[0], "end": time.perf_counter(), "tokens": tokens, "mfs": served}


def summarize_runs(runs: list[dict], wall: float, new_tokens: int) -> dict:
    tok = sum(r["tokens"] for r in runs)
    return {"requests": len(runs), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
            "tpot_ms": 1e3 * sum((r["end"] - r["first"]) / (new_tokens - 1) for r in runs) / len(runs),
            "ttft_ms": 1e3 * sum(r["first"] - r["start"] for r in runs) / len(runs)}


async def measure(session, url: str, models: list[str], prompts: list[list[int]], new_tokens: int) -> dict:
    t = time.perf_counter()
    runs = await asyncio.gather(*(stream_one(session, url, m, p, new_tokens) for m, p in zip(models, prompts)))
    res = summarize_runs(list(runs), time.perf_counter() - t, new_tokens)
    res["served"] = sorted({json.dumps(r["mfs"], sort_keys=True) for r in runs if r["mfs"] is not None})
    return res


async def served_ppl(session, url: str, model: str, windows: list[list[int]]) -> float:
    """exp(mean NLL) of each window's tokens after its first, from the served prompt logprobs."""
    nll, n = 0.0, 0
    for w in windows:
        body = {"model": model, "prompt": w, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body) as resp:
            doc = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"perplexity: HTTP {resp.status}: {json.dumps(doc)[:300]}")
        lps = doc["choices"][0]["logprobs"]["token_logprobs"]
        got = [lp for lp in lps[1:] if lp is not None]
        nll -= sum(got)
        n += len(got)
    return math.exp(nll / n)


async def compiled_in_use(session, url: str, model: str, prompt: list[int], launched: float,
                          timeout_s: float = 600.0, not_yet: tuple[str, ...] = ("eager",)) -> float | None:
    """Seconds from launch until an answer of ``model`` names no path of ``not_yet`` (a worker builds its
    graphs in the background and serves eagerly meanwhile, then on the trunk's graphs with its exit blocks
    eager: the timed runs wait for the whole path); None: not there after ``timeout_s`` (compiled decode
    off, or not built here), and the runs are timed as they are."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        r = await stream_one(session, url, model, prompt, 2)
        paths = (r["mfs"] or {}).get("paths", [])
        if paths and not set(paths) & set(not_yet):
            return r["end"] - launched
        await asyncio.sleep(1.0)
    return None


async def _run(spec, url: str, launched: float, singles: int, compiling: bool) -> dict:
    ids = model_ids(url)  # tier ids, lowest first
    top = ids[-1]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        first = await stream_one(s, url, top, spec.prompts[0], 2)
        out = {"first_token_after_launch_s": first["first"] - launched, "first_answer_mfs": first["mfs"]}
        if compiling:  # `mfs up` said it asks for compiled decode (its start line)
            out["compiled_after_launch_s"] = await compiled_in_use(s, url, top, spec.prompts[0], launched)
            # the lowest tier runs an exit block: its answers name inductor-trunk until those graphs are in
            out["compiled_all_after_launch_s"] = await compiled_in_use(
                s, url, ids[0], spec.prompts[0], launched, not_yet=("eager", "inductor-trunk"))
        tries = [await measure(s, url, [top], spec.prompts[:1], spec.new_tokens) for _ in range(singles)]
        out["single"] = max(tries, key=lambda r: r["tokens_per_s"])  # best of N, as the figures
        out["single"]["tries_tokens_per_s"] = [r["tokens_per_s"] for r in tries]
        out["concurrent"] = await measure(s, url, [top] * len(spec.prompts), spec.prompts, spec.new_tokens)
        out["family_mix"] = await measure(s, url, [ids[t] for t in spec.mix], spec.prompts, spec.new_tokens)
        if spec.long_prompt:  # one request alone: its first token is the prompt's prefill
            r = await stream_one(s, url, top, spec.long_prompt, 2)
            out["long_prompt"] = {"prompt_tokens": len(spec.long_prompt), "ttft_ms": 1e3 * (r["first"] - r["start"])}
        out["ppl_top"] = await served_ppl(s, url, top, spec.windows)
        after = await stream_one(s, url, top, spec.prompts[0], 2)
        out["last_answer_mfs"] = after["mfs"]
    return out


def run_api(spec, *, singles: int = 3, start_timeout_s: float = 600.0) -> dict:
    """The contender's record, in the in-process contenders' shape (``single``, ``concurrent``,
    ``family_mix``, ``ppl_top``), named so `ratios_vs_llama_cpp` counts it as MFS."""
    if not spec.device.startswith("cpu"):
        raise ValueError("the api contender serves what `mfs up` picks on this machine: run it with --device cpu")
    proc, url, log, launched = start_mfs_up(spec.model, start_timeout_s, tuple(spec.up_args))
    try:
        res = asyncio.run(_run(spec, url, launched, singles, "decode compiled" in log.read_text()))
        by_role = tree_rss_bytes(proc.pid)  # resident while serving: every weight page touched by now
        res.update(rss_bytes=sum(by_role.values()), rss_by_role=by_role, worker_rss_bytes=by_role.get("worker", 0),
                   up_args=list(spec.up_args))
        res["start_log"] = [ln for ln in log.read_text().splitlines() if ln.startswith("mfs up")][:8]
    finally:
        stop_mfs_up(proc)
    flags = f"mfs up {' '.join(spec.up_args)}" if spec.up_args else "mfs up defaults"
    return {"name": f"mfs api ({flags})", **res}
