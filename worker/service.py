"""The worker process: holds the nested model (or one standalone tier) and its KV tensors; the protocol
around it (registration, heartbeat, plans in, tokens and results out) is worker/loop.py."""
from __future__ import annotations

import argparse
import getpass
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from core import protocol as P
from core.cli import add_args, from_args, opt, positive_int
from core.redisconn import RedisTarget, add_redis_args, connect, target_from_args
from worker.background_compile import BackgroundCompile
from worker.family import ModelArgs
from worker.formats import FORMATS, may_quantize, quantize_model, resolve_mode, served, served_why, weights_why
from worker.formats.fp32 import FORMAT as FP32
from worker.loop import WorkerLoop, WorkerSpec
from worker.memory import release_memory
from worker.runner import ModelRunner, blocks_within

AUTO_BLOCKS_MOST = 1024  # a pool sized from --kv-cache-mb holds at most this many blocks per segment


@dataclass(slots=True)
class WorkerConfig(ModelArgs):
    """Every knob of one worker process (its model's, then its own); ``python -m worker``'s flags."""
    worker_id: str = opt(default_factory=lambda: f"w-{os.getpid()}")
    num_blocks: int | None = opt(None, "KV blocks per segment pool (default: as many as --kv-cache-mb holds, "
                                       "at most 1024, at least one --max-model-len request's)")
    kv_cache_mb: int = opt(256, "memory for the KV pools, every segment's together, when --num-blocks is not given",
                           parse=positive_int)
    block_size: int = 16
    max_model_len: int = 4096
    shard: str = opt(P.DEFAULT_SHARD, parse=P.Shard.check,
                     help="the control-plane shard to join (the scheduler started with the same --shard plans "
                          "this worker's steps)")
    standalone_tier: int | None = opt(None, "serve only this tier, as its own truncated copy (the independent "
                                            "layout)")
    threads: int = opt(default_factory=lambda: len(os.sched_getaffinity(0)),
                       help="torch threads (default: the cores this process may run on; `mfs up` splits them "
                            "between its workers)")
    compile: Literal["auto", "on", "off"] = opt(
        "off", "all-decode steps as compiled graphs, built in the background while the worker serves on the "
               "eager path, swapped in between two steps (worker/background_compile.py): on CPU (the torch ops) "
               "inductor's, cached under $MFS_CACHE/inductor (the trunk's graphs first, then the exit blocks'); on CUDA (the triton ops) CUDA graphs per "
               "batch-size bucket. auto: where they build (what `mfs up` and compose.yaml pass); on: refused "
               "where they cannot; off: eager")


class WorkerService(WorkerLoop):
    """A worker that runs the nested model (or one standalone tier of it)."""

    def __init__(self, cfg: WorkerConfig, redis_target: RedisTarget):
        from worker.family import load_family  # noqa: PLC0415
        from worker.model import standalone_tier  # noqa: PLC0415
        standalone = cfg.standalone_tier is not None
        if str(cfg.device).startswith("cpu"):  # a cold start compiles our operators while it reads the weights
            from kernels import cpu_argmax, cpu_attention, cpu_gemv  # noqa: PLC0415
            cpu_gemv.build_in_background([cpu_argmax.SOURCE], "MFS_CPU_ARGMAX")  # greedy sampling's
            if may_quantize(cfg.weights):
                cpu_gemv.build_in_background()
            if cfg.compile != "off":
                cpu_gemv.build_in_background([cpu_attention.SOURCE], "MFS_CPU_ATTENTION")
        # A standalone tier is cut from the family as loaded, then quantized like the nested one.
        fam = load_family(cfg.model, tiers=cfg.tiers, dtype=cfg.dtype, device=cfg.device,
                          kernels=cfg.kernels, weights=FP32.name if standalone else cfg.weights)
        # after the load: resolving auto waits for our operators (it asks whether they serve), which
        # compile while the weights are read (a bad --weights is refused by the load's quantization first)
        model, base = fam.model, fam.base  # base: its tokenizer, read for the first grammar request
        self.weights = resolve_mode(served(cfg.weights, cfg.device, base.source), cfg.device)
        ntiers = len(model.tiers)
        if standalone:
            k = cfg.standalone_tier
            if not 0 <= k < ntiers:
                raise ValueError(f"--standalone-tier {k}: the family has tiers 0..{ntiers - 1}")
            model, tiers, tier_map, nseg = standalone_tier(model, k), [k], {k: 0}, 1
            source = base.source
            del fam  # the rest of the family is not this worker's: give its memory back
            release_memory()
            if FORMATS[self.weights].quantizes:
                quantize_model(model, self.weights, gguf_path=source, device=cfg.device,
                               load_tokenizer=lambda: base.tokenizer)
        else:
            tiers, tier_map, nseg = list(range(ntiers)), None, ntiers
        release_memory()  # the load's transients (the GGUF's blocks read, rows dequantized to compare)
        max_len = min(cfg.max_model_len, model.max_positions)
        num_blocks = [cfg.num_blocks or blocks_within(model, cfg.block_size, cfg.kv_cache_mb << 20, max_len,
                                                      AUTO_BLOCKS_MOST)] * nseg
        runner = ModelRunner(model, num_blocks, cfg.block_size, tier_map=tier_map,
                             load_tokenizer=lambda: base.tokenizer)
        from worker.execution import EAGER, choose  # noqa: PLC0415
        self.path, why = choose(model, cfg.compile)  # ValueError: --compile on where no compiled path serves
        why_w = served_why(cfg.weights, cfg.device, base.source)
        kv_mb = sum(runner.kv.bytes_per_block(s) * n for s, n in enumerate(num_blocks)) / 2**20
        self.choice = (f"weights {self.weights} ({why_w}); {cfg.threads} torch "
                       f"threads of {len(os.sched_getaffinity(0))} cores; KV {num_blocks[0]} blocks of "
                       f"{cfg.block_size} per segment pool ({kv_mb:.0f} MB); decode {self.path} ({why})")
        self.compiling = None if self.path == EAGER else BackgroundCompile(runner, self.path)
        self.model = model
        if str(cfg.device).startswith("cpu"):  # greedy sampling's operator, loaded (built meanwhile) before serving
            from kernels.cpu_argmax import argmax_kernel  # noqa: PLC0415
            argmax_kernel()
        mcfg = model.cfg
        spec = WorkerSpec(tiers, ntiers, num_blocks, cfg.block_size, max_len,
                          mcfg.vocab_size, list(mcfg.eos_token_ids), device=str(runner.device),
                          kernels=model.ops.name, weights=self.weights, choice=self.choice, shard=cfg.shard,
                          exit_blocks=[] if standalone else list(model.exit_block_segments),
                          kv_window=model.kv_window)
        super().__init__(cfg.worker_id, connect(redis_target), runner, spec)

    def run(self) -> None:
        """Serves at once (eagerly); the compiled path, if chosen, is built meanwhile and swapped in."""
        if self.compiling is not None:
            self.compiling.start()
        super().run()


def inductor_cache_dir(env, mfs_cache: Path) -> str:
    """Where this worker's compiled graphs go: ``$TORCHINDUCTOR_CACHE_DIR`` where a user set it, else
    ``$MFS_CACHE/inductor``. torch's own default (``/tmp/torchinductor_<user>``) counts as unset: the first
    time any code in a process touches inductor's caches, torch writes that default into the process's
    environment (transformers' GGUF tokenizer load does, on a cold cache), and every child inherits it.
    A worker started below such a process (`mfs bench peers` on a fresh machine) compiled into /tmp, and
    the next start, reading $MFS_CACHE, compiled again (65.7 s for the trunk's graphs against 15.6)."""
    given = env.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(torch_default_inductor_dir()):
        return given
    return str(mfs_cache / "inductor")


def torch_default_inductor_dir() -> str:
    """torch's ``torch._inductor.runtime.cache_dir_utils.default_cache_dir()``, without importing inductor
    (whose package imports dynamo: ~1.7 s of a worker's start that compiles nothing, on 2 cores);
    tests/test_inductor_cache.py checks the two agree."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def main(argv: list[str] | None = None) -> int:
    from core.logs import configure, install_stop_signals  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m worker", description="MFS worker process")
    add_redis_args(p)
    add_args(p, WorkerConfig)
    args = p.parse_args(argv)
    cfg = from_args(WorkerConfig, args)
    configure(json_lines=True)
    install_stop_signals()
    torch.set_num_threads(cfg.threads)
    from family.source import cache_root  # noqa: PLC0415
    # inductor's caches (compiled graphs, their C++) under MFS's own: a second start loads them
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(os.environ, cache_root())
    svc = WorkerService(cfg, target_from_args(args))
    import structlog  # noqa: PLC0415
    # one line: what this worker chose and why (ISA, weights, threads, decode path)
    structlog.get_logger(__name__).info(f"worker {cfg.worker_id} on {torch.backends.cpu.get_cpu_capability()}"
                                        f" ({cfg.device}): {svc.choice}")
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    finally:
        svc.deregister()
    return 0
