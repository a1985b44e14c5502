"""The background build of a serving worker's compiled decode path (:class:`BackgroundCompile`), swapped in
when built: the worker serves eagerly meanwhile, a start nobody waits on.

The worker registers at once and serves on the eager path. A background thread builds the compiled path
meanwhile and hands it to the runner, which applies it between two steps (``ModelRunner.swap_in``); each
token event names the path its step ran (``TokenEvent.path``), so a client sees which computed it (the
compiled graphs may round differently from the eager ops: worker/execution.py). Inductor's path comes in
two swaps: first the trunk's graphs (``inductor-trunk``: exit blocks eager), then, once the exit blocks'
graphs are built too, the whole path (``inductor``). The trunk's graphs are a third of the build (two of
six graphs for the default family, the largest ones); the top tier's requests compute the same under
both.

Inductor's graphs are built by running throw-away requests (``ModelRunner.warm_up``) through a *shadow*
of the model -- a shallow copy: the same modules and weights under an ``execution`` of its own (a path
changes nothing else on a model, worker/execution.py) -- over a scratch runner's own small KV pools, so
the serving runner's model, pools and requests are never touched until the swap. The graphs are dynamic
in the batch, the context and the pools' size, so the serving pools reuse them (tests/test_execution.py
checks that no step recompiles after the swap). CUDA graphs bind the serving pools' addresses, so they
are recorded at the swap, by the path's ``apply`` over the serving runner's pools (seconds on a GPU).
"""
from __future__ import annotations

import copy
import threading
import time

import structlog

from worker.execution import CUDA_GRAPHS, CudaGraphDecode, InductorDecode
from worker.runner import ModelRunner

log = structlog.get_logger(__name__)

SCRATCH_BLOCKS = 8  # per segment: the warm-up's two requests of two blocks each, with room to spare


def shadow(model):
    """The model's modules and weights (the same objects) under an ``execution`` of its own, eager: a path
    applied to it leaves the served model's alone."""
    sh = copy.copy(model)
    sh.execution = None
    return sh


def prime_fx_tracing(step_lock: threading.Lock) -> None:
    """Inductor traces a toy function with torch.fx the first time it lowers a graph in a process
    (``loop_body.InterpreterShim._dummy_gm``, cached). While it traces, torch.fx replaces
    ``nn.Module.__call__`` for the whole process, and a module the serving thread calls meanwhile fails
    with "module is not installed as a submodule" (seen once in a fresh-clone run of the suite, in an
    eager step of tests/test_execution.py). So the build does it first, imported on its own thread and
    traced under the runner's step lock: one pause of a few milliseconds between two steps."""
    try:
        from torch._inductor.loop_body import InterpreterShim  # noqa: PLC0415
    except ImportError:  # another torch: nothing of this kind to do first
        return
    with step_lock:
        InterpreterShim._dummy_gm()


class BackgroundCompile:
    """Builds ``path`` (worker/execution.py: inductor or cuda-graphs) for ``runner``'s model on a thread and
    swaps it in when built. ``done`` is set at the end either way; ``error`` says why it failed (the
    worker then keeps serving eagerly), ``seconds`` how long the build took, ``first_seconds`` how long
    until its first swap (inductor's trunk graphs; the whole build where there is one swap)."""

    def __init__(self, runner: ModelRunner, path: str):
        self.runner, self.path = runner, path
        self.done = threading.Event()
        self.error: str | None = None
        self.seconds = self.first_seconds = 0.0
        self.thread = threading.Thread(target=self._build, daemon=True, name="compile-decode")

    def start(self) -> "BackgroundCompile":
        self.thread.start()
        return self

    def _build(self) -> None:
        t0 = time.perf_counter()
        model = self.runner.model
        try:
            if self.path == CUDA_GRAPHS:
                from worker.decode_graphs import DecodeGraphs  # noqa: PLC0415
                built = CudaGraphDecode(DecodeGraphs(model))
            else:
                prime_fx_tracing(self.runner.step_lock)
                built = InductorDecode(model)
                sh = shadow(model)
                scratch = ModelRunner(sh, [SCRATCH_BLOCKS] * model.num_segments, self.runner.block_size,
                                      tier_map=self.runner.tier_map)
                if built.exits:  # the trunk's graphs first, swapped in while the exit blocks' build
                    trunk = built.trunk_only()
                    trunk.apply(sh)
                    scratch.warm_up(part="top")
                    self.first_seconds = time.perf_counter() - t0
                    self.runner.swap_in(trunk)
                    log.info("trunk graphs built; the step loop swaps them in (exit blocks eager until "
                             "theirs are built)", path=trunk.name, seconds=round(self.first_seconds, 1))
                    built.apply(sh)
                    scratch.warm_up(part="exits")
                else:
                    built.apply(sh)
                    scratch.warm_up()
                del scratch
            self.seconds = time.perf_counter() - t0
            self.first_seconds = self.first_seconds or self.seconds
            self.runner.swap_in(built)
            log.info("compiled decode built; the step loop swaps it in before its next step", path=self.path,
                     seconds=round(self.seconds, 1))
        except Exception as e:  # inductor's failures (no C++ compiler, ...), CUDA's errors: many types
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
            log.error("building the compiled decode failed: this worker keeps serving on the eager path",
                      path=self.path, error=self.error)
        finally:
            self.done.set()
