"""`mfs lm-eval`: the family scored by lm-evaluation-harness (a client no one here wrote), through the
service as a user runs it, and the same task in-process through transformers for comparison.

1. `mfs up`'s processes serve the family (`service.launch.Service`);
2. for every tier, `lm_eval --model local-completions` against `/v1/completions`: a multiple-choice task
   scored by log-likelihood, i.e. `echo` with `logprobs` on prompt + choice;
3. the service stops; `lm_eval --model hf` loads the family's base weights (the GGUF's dequantized
   cache, a Hugging Face directory) and scores the same task in-process.

The top tier is the base model unchanged, so its accuracy through MFS must equal transformers'. The
task is `evals/capitals/` (nothing from a hub). lm-eval is an optional extra: `make lm-eval`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from engine.runtime import write_json

EVALS = Path(__file__).resolve().parents[1] / "evals"
TASK = "mfs_capitals"  # the default task (--task capitals); the others: evaluation/mc_tasks.py


def _task_dir(work: Path, name: str) -> Path:
    """Task ``name``'s YAML with the data file's absolute path (lm-eval resolves it from the working dir)."""
    src = EVALS / name
    if not (src / f"mfs_{name}.yaml").exists():
        raise FileNotFoundError(f"{src / f'mfs_{name}.yaml'}: no such task")
    text = (src / f"mfs_{name}.yaml").read_text().replace("DATA_FILE", str(src / f"{name}.jsonl"))
    d = work / "tasks"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"mfs_{name}.yaml").write_text(text)
    return d


def _portable(cmd: list[str], names: dict[str, str]) -> str:
    """The command as anyone can rerun it: this run's paths and URL named ($WORK, $BASE, $URL)."""
    text = " ".join(["python"] + cmd[1:])
    for value, name in names.items():
        text = text.replace(value, name)
    return text


def _lm_eval(model: str, model_args: str, tasks: Path, out: Path, extra: list[str], log: Path,
             names: dict[str, str], task: str = TASK) -> dict:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    t0 = time.monotonic()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise RuntimeError(f"lm_eval --model {model} failed ({r.returncode}); its output: {log}")
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"lm_eval wrote no results under {out}; its output: {log}")
    res = json.loads(found[-1].read_text())["results"][task]
    samples = sorted(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    loglik = {}  # item -> the log-likelihood of each choice
    for line in samples[-1].read_text().splitlines() if samples else []:
        d = json.loads(line)
        loglik[d["doc_id"]] = [float(r[0]) for r in d["filtered_resps"]]
    return {"acc": res["acc,none"], "acc_stderr": res.get("acc_stderr,none"), "items": len(loglik),
            "seconds": round(time.monotonic() - t0, 1), "command": _portable(cmd, names), "loglik": loglik}


def add_parser(sub) -> None:
    p = sub.add_parser("lm-eval", help="the family scored by lm-evaluation-harness through the API, "
                                       "and the top tier in-process through transformers")
    p.add_argument("--model", default="default")
    p.add_argument("--task", default="capitals",
                   help="a task under evals/: capitals, stdlib_modules, unicode_names (evaluation/mc_tasks.py; "
                        "`mfs eval --tasks` scores the same files in-process, faster)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the worker (0: its default)")
    p.add_argument("--concurrency", type=int, default=2, help="lm-eval's concurrent API requests")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items (a quick look)")
    p.add_argument("--json", default=None)
    p.add_argument("--work-dir", default=None, help="lm-eval outputs and logs (default: a temp dir)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import lm_eval  # noqa: F401, PLC0415
    except ImportError:
        raise ValueError("lm-eval is not installed: `make lm-eval` (or .venv/bin/pip install "
                         "'lm-eval==0.4.13')") from None
    from family.manifest import manifest_for, resolve_base  # noqa: PLC0415
    from family.source import resolve_cached  # noqa: PLC0415
    from service.launch import Service  # noqa: PLC0415
    from worker.family import load_family  # noqa: PLC0415

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mfs-lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    tasks = _task_dir(work, args.task)
    task = f"mfs_{args.task}"
    limit = ["--limit", str(args.limit)] if args.limit else []
    manifest, mdir = manifest_for(args.model)
    folder, gguf = resolve_cached(resolve_base(manifest.base, mdir))
    if gguf:  # the dequantized cache is written by the first load: make it exist
        load_family(args.model)
        folder, gguf = resolve_cached(resolve_base(manifest.base, mdir))
    if gguf:
        raise RuntimeError(f"no Hugging Face copy of {folder / gguf} to give transformers")
    print(f"mfs lm-eval: task {task} ({EVALS / args.task}), base weights {folder}; outputs in {work}", flush=True)
    # in the recorded commands: $WORK (the task YAML is $WORK/tasks), $BASE (the base weights), $URL
    names = {str(work): "$WORK", str(folder): "$BASE"}
    worker_args = ["--threads", str(args.threads)] if args.threads else []
    tiers: dict[str, dict] = {}
    with Service(args.model, workers=1, schedulers=1, worker_args=worker_args) as svc:
        with urllib.request.urlopen(svc.url + "/v1/models", timeout=10) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        for mid in [f"{manifest.family}-{t.name}" for t in manifest.tiers]:
            if mid not in ids:
                raise RuntimeError(f"the service does not list {mid} (it lists {ids})")
            margs = (f"model={mid},base_url={svc.url}/v1/completions,num_concurrent={args.concurrency},"
                     f"max_retries=3,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={folder}")
            tiers[mid] = _lm_eval("local-completions", margs, tasks, work / mid, limit + ["--batch_size", "1"],
                                  work / f"{mid}.log", {**names, svc.url: "$URL"}, task)
            print(f"  {mid:28s} acc {tiers[mid]['acc']:.3f} ({tiers[mid]['seconds']:.0f} s)", flush=True)
    hf = _lm_eval("hf", f"pretrained={folder},dtype=float32", tasks, work / "transformers",
                  limit + ["--batch_size", "8", "--device", "cpu"], work / "transformers.log", names, task)
    top = f"{manifest.family}-{manifest.tiers[-1].name}"
    print(f"  {'transformers (in-process)':28s} acc {hf['acc']:.3f} ({hf['seconds']:.0f} s)")
    same = tiers[top]["acc"] == hf["acc"]
    a, b = tiers[top]["loglik"], hf["loglik"]
    if set(a) != set(b):
        raise RuntimeError(f"the two runs scored different items ({len(a)} vs {len(b)})")
    diff = max((abs(x - y) for k in a for x, y in zip(a[k], b[k])), default=0.0)
    print(f"mfs lm-eval: top tier {top} {'equals' if same else 'DIFFERS FROM'} transformers "
          f"({tiers[top]['acc']:.4f} vs {hf['acc']:.4f}); largest log-likelihood difference over "
          f"{len(a)} items x 4 choices: {diff:.2e}")
    out = {"benchmark": "lm-eval", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "task": task, "model": args.model, "limit": args.limit, "tiers": tiers, "transformers": hf,
           "top_tier_equals_transformers": same, "top_tier_max_loglik_diff": diff}
    if args.json:
        write_json(args.json, out)
    return 0 if same else 1
