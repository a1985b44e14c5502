"""`mfs up`: starts the service's processes (service.launch.Service), says where it serves, and
supervises them until SIGINT/SIGTERM or a crash loop (service.supervise.Supervisor); then stops
everything it started."""
from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request

from core.logs import install_stop_signals
from core.redisconn import DEFAULT_TIMEOUT_S, RedisTarget, target_from_args
from service.launch import Service
from service.supervise import RestartPolicy, Supervisor


def service_from_args(args) -> Service:
    """The Service `mfs up`'s flags describe; its children die with this process."""
    worker_args = ["--threads", str(args.threads)] if args.threads else []  # else split (Service.start)
    # the product's defaults (mfs/commands.py: add_up): weights by the CPU, compiled decode where it builds
    worker_args += ["--weights", args.weights, "--compile", args.compile]
    if getattr(args, "kv_cache_mb", None) is not None:
        worker_args += ["--kv-cache-mb", str(args.kv_cache_mb)]
    for flag in ("device", "kernels"):
        if getattr(args, flag, None):
            worker_args += [f"--{flag}", getattr(args, flag)]
    external = args.redis_url or args.redis_sentinel
    return Service(args.model, tiers=args.tiers, workers=args.workers, layout=args.layout,
                   host=args.host, port=args.port, worker_args=worker_args, dtype=args.dtype,
                   schedulers=args.schedulers, shards=args.shards, log_dir=args.log_dir, die_with_parent=True,
                   scheduler_args=["--decode-steps", str(args.decode_steps),
                                   "--stream-interval", str(args.stream_interval)],
                   redis_url=target_from_args(args).as_url() if external else None,
                   redis_timeout=args.redis_timeout if args.redis_timeout != DEFAULT_TIMEOUT_S else None)


def try_command(url: str) -> str:
    """One line a user can paste: a short chat request to the family id (the gateway picks the tier)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            family = json.loads(r.read())["data"][-1]["id"]  # the last entry is the family id
    except (OSError, ValueError, KeyError, IndexError):
        family = "MODEL"  # the models list did not answer: say where the name goes
    body = json.dumps({"model": family, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}]})
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def supervise(svc: Service, policy: RestartPolicy) -> int:
    """Restarts what exits until a crash loop (returns 1); SIGINT/SIGTERM end it as KeyboardInterrupt."""
    sup = Supervisor(svc, policy, say=say)
    while True:
        why = sup.poll()
        if why:
            say(f"mfs up: {why}")
            return 1
        time.sleep(0.25)


def up(args) -> int:
    policy = RestartPolicy(limit=args.restart_limit, window_s=args.restart_window)
    svc = service_from_args(args)
    print(f"mfs up: starting {args.layout} layout of {args.model!r} with {args.workers} worker(s); "
          f"logs in {svc.log_dir}", flush=True)
    # Both signals stop it, even when it was started with SIGINT ignored (a script's background job).
    install_stop_signals()
    status = 0
    try:
        # compiled decode builds in the background after a worker registers: nothing here waits on it. A cold
        # first start builds our kernels (g++) and reads and quantizes the GGUF: minutes on 2 busy cores
        svc.start(timeout=600.0)
        print(f"mfs up: serving at {svc.url}/v1  (redis {RedisTarget.parse(svc.redis_url).describe()}); "
              "Ctrl-C stops everything", flush=True)
        print(f"mfs up: status page {svc.url}/ ; try:\n  {try_command(svc.url)}", flush=True)
        status = supervise(svc, policy)
    except KeyboardInterrupt:
        pass
    finally:
        # A second signal must not cut the clean-up short and leave workers running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("mfs up: stopping", flush=True)
        svc.stop()
    return status
