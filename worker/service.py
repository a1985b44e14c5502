"""The worker process: holds the nested model (or one standalone tier) and its KV tensors; the protocol
around it (registration, heartbeat, plans in, tokens and results out) is worker/loop.py."""
from __future__ import annotations

import argparse
import os

import torch

from core import protocol as P
from core.redisconn import add_redis_args, connect, target_from_args
from worker.loop import WorkerLoop, WorkerSpec
from worker.runner import ModelRunner


class WorkerService(WorkerLoop):
    """A worker that runs the nested model (or one standalone tier of it)."""

    def __init__(self, args):
        from worker.family import load_family  # noqa: PLC0415
        from worker.model import standalone_tier  # noqa: PLC0415
        standalone = args.standalone_tier is not None
        from worker.quant import resolve_mode  # noqa: PLC0415
        self.weights = resolve_mode(args.weights, args.device)
        # A standalone tier is cut from the fp32 family, then quantized like the nested one.
        fam = load_family(args.model, tiers=args.tiers, dtype=args.dtype, device=args.device,
                          kernels=args.kernels, weights="fp32" if standalone else args.weights)
        model, tokenizer = fam.model, fam.tokenizer  # the tokenizer: for grammars (structured output)
        ntiers = len(model.tiers)
        if standalone:
            k = args.standalone_tier
            if not 0 <= k < ntiers:
                raise ValueError(f"--standalone-tier {k}: the family has tiers 0..{ntiers - 1}")
            model, tiers, tier_map, nseg = standalone_tier(model, k), [k], {k: 0}, 1
            source = fam.base.source
            del fam  # the rest of the family is not this worker's: give its memory back
            _release_memory()
            if self.weights != "fp32":
                from worker.quant import quantize_model  # noqa: PLC0415
                quantize_model(model, self.weights, gguf_path=source, device=args.device)
        else:
            tiers, tier_map, nseg = list(range(ntiers)), None, ntiers
        num_blocks = [args.num_blocks] * nseg
        runner = ModelRunner(model, num_blocks, args.block_size, tier_map=tier_map, tokenizer=tokenizer)
        self.model = model
        cfg = model.cfg
        spec = WorkerSpec(tiers, ntiers, num_blocks, args.block_size, min(args.max_model_len, model.max_positions),
                          cfg.vocab_size, list(cfg.eos_token_ids), device=str(runner.device),
                          kernels=model.ops.name, weights=self.weights, shard=args.shard)
        super().__init__(args.worker_id, connect(target_from_args(args)), runner, spec)


def _release_memory() -> None:
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    from worker.family import add_model_args  # noqa: PLC0415
    from core.logs import configure, install_stop_signals  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m worker", description="MFS worker process")
    add_model_args(p)
    p.add_argument("--worker-id", default=f"w-{os.getpid()}")
    add_redis_args(p)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per segment pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--shard", default=P.DEFAULT_SHARD,
                   help="the control-plane shard to join (the scheduler started with the same --shard "
                        "plans this worker's steps)")
    p.add_argument("--standalone-tier", type=int, default=None,
                   help="serve only this tier, as its own truncated copy (the independent layout)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads (default: all cores but one, which the gateway and scheduler use)")
    args = p.parse_args(argv)
    try:
        P.Shard(args.shard)
    except ValueError as e:
        p.error(str(e))
    configure(json_lines=True)
    install_stop_signals()
    torch.set_num_threads(args.threads)
    import structlog  # noqa: PLC0415
    structlog.get_logger(__name__).info(
        "worker compute", threads=args.threads, cpus=os.cpu_count(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(), device=args.device, weights=args.weights)
    svc = WorkerService(args)
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    finally:
        svc.deregister()
    return 0
