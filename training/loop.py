"""The trainer loop every precipitation method runs in: the budget clock (``--max-minutes``), the step
budget (``--steps``, ``--stop-after``), the evaluation cadence and patience, the best state's export,
checkpoints and ``--resume``, the logs and the progress lines.

A method (LoRA, exit blocks, joint) is a plug-in, a :class:`Method`: it prepares its model and data,
draws the batch of a step (a function of seed and step, so a resumed run sees the batches an
uninterrupted one would), takes one optimizer step, evaluates on held-out text, exports its artifact,
and says what its checkpoint holds. The loop owns the rest:

* ``OUT/state/trainer.pt``: the method's tensors and optimizer plus the loop's counters
  (:class:`RunState`), written atomically every ``save_every_min`` minutes, after every evaluation and
  at the end; ``--resume`` continues from it.
* ``OUT/eval_log.jsonl`` (one record per evaluation) and ``OUT/train_log.jsonl`` (one per step, for the
  methods that give a record): a resumed run drops the lines past its checkpoint, a fresh one starts
  them empty.
* With evaluations, the best state so far (lowest score) is exported and a run stops after
  ``patience`` evaluations without improvement; without them, every checkpoint exports.
* The budget is counted from the start of the command; training stops while the time left still
  holds the last evaluation's time plus ``reserve_s``, so the final evaluation and export fit in it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.runtime import progress

STATE = "state/trainer.pt"
EVAL_LOG = "eval_log.jsonl"
STEP_LOG = "train_log.jsonl"
BETTER_BY = 1e-4  # an evaluation improves on the best when its score is lower by more than this


class Budget:
    """``--max-minutes`` as a deadline on :attr:`clock` (``time.monotonic``, the clock the data
    stage's deadlines use), counted from when the budget is made: the start of the command."""

    clock = staticmethod(time.monotonic)

    def __init__(self, minutes: float | None):
        if minutes is not None and minutes < 0:
            raise ValueError(f"--max-minutes must be >= 0 (0: no budget), not {minutes}")
        self.start = self.clock()
        self.end = self.start + minutes * 60 if minutes else None

    def now(self) -> float:
        return self.clock()

    def left(self) -> float | None:
        """Seconds left, or None without a budget."""
        return None if self.end is None else self.end - self.clock()

    def share(self, fraction: float) -> float | None:
        """The deadline at ``fraction`` of the budget (a :attr:`clock` time), or None without one."""
        return None if self.end is None else self.start + (self.end - self.start) * fraction

    def spent(self, reserve_s: float = 0.0) -> bool:
        return self.end is not None and self.clock() + reserve_s >= self.end

    def lift(self) -> None:
        self.end = None

    def minutes(self) -> float:
        """Minutes since the start."""
        return (self.clock() - self.start) / 60

    def decay(self, minutes: float) -> float:
        """An lr factor: 1, then over the last ``minutes`` of the budget linearly down to 0.1."""
        left = self.left()
        if left is None or not minutes:
            return 1.0
        return min(1.0, max(0.1, left / (minutes * 60)))


@dataclass(slots=True)
class RunState:
    """The loop's counters; a checkpoint restores them with the method's tensors."""
    step: int = 0
    tokens: int = 0
    train_s: float = 0.0  # seconds in optimizer steps (batch assembly, evaluation and saving aside)
    best: dict | None = None  # {"score", "step", "eval"} of the best evaluation so far
    bad_evals: int = 0  # evaluations since the best
    history: list = field(default_factory=list)  # every evaluation's eval_log record

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_s, 1e-9)


@dataclass(slots=True)
class StepResult:
    tokens: int  # tokens this step trained on
    losses: str  # each tier's losses, for the progress bar and lines
    record: dict | None = None  # the method's fields of this step's train_log.jsonl line (None: no line)


@dataclass(slots=True)
class Evaluation:
    metrics: dict  # the method's fields of the eval_log.jsonl record
    score: float  # lower is better
    detail: dict  # kept as the best state's "eval"
    record: dict = field(default_factory=dict)  # the whole record (step, tokens, train_minutes, metrics)


@dataclass(slots=True)
class Options:
    """What the loop reads from the command line, besides the budget."""
    out: Path
    desc: str  # progress bar label
    resume: bool = False
    threads: int = 1
    seed: int = 0
    stop_after: int | None = None  # steps of this invocation
    save_every_min: float = 0.0  # checkpoint and progress-line period; 0: at evaluations and the end
    bar_interval: float = 1.0  # seconds between progress bar redraws
    eval_every: int = 0  # steps between evaluations; 0: none (then every checkpoint exports)
    patience: int = 0  # evaluations without improvement before stopping; 0: never
    reserve_s: float = 0.0  # kept at the budget's end beyond the last evaluation's time

    @classmethod
    def of(cls, args, desc: str, **kw) -> Options:
        return cls(out=Path(args.out), desc=desc, resume=args.resume, threads=args.threads, seed=args.seed,
                   stop_after=args.stop_after, save_every_min=args.save_every_min,
                   bar_interval=args.bar_interval, **kw)


class Method:
    """A training method, plugged into :class:`Trainer`."""

    total: int  # the steps it plans (the progress bar's total); the run ends there

    def prepare(self, resuming: bool) -> None:
        """Model, data and optimizer; ``resuming``: a checkpoint is loaded next (so no warm start)."""
        raise NotImplementedError

    def batch(self, step: int):
        """The batch of ``step``, a function of the seed and ``step``."""
        raise NotImplementedError

    def step(self, step: int, batch) -> StepResult:
        """One optimizer step on ``batch``."""
        raise NotImplementedError

    def evaluate(self) -> Evaluation:
        """The held-out evaluation (methods run with ``Options.eval_every`` > 0)."""
        raise NotImplementedError

    def export(self, run: RunState, ev: Evaluation | None) -> None:
        """Writes the artifact: the best state (``ev`` is its evaluation) or, without evaluations,
        the current one (``ev`` None)."""
        raise NotImplementedError

    def state_dict(self, run: RunState) -> dict:
        """What ``OUT/state/trainer.pt`` holds, ``run`` included."""
        raise NotImplementedError

    def load_state_dict(self, saved: dict) -> RunState:
        """Restores what :meth:`state_dict` saved; returns the loop's counters."""
        raise NotImplementedError

    def on_budget(self, step: int) -> int | None:
        """The budget ran out before ``step``: None stops the run; a number lifts the budget and
        becomes :attr:`total` (a method that finishes with a phase of its own)."""
        return None


def tensors_state(model: torch.nn.Module, keep, key: str, opt, gen: torch.Generator, run: RunState) -> dict:
    """A :meth:`Method.state_dict` of the model's tensors whose names ``keep`` accepts (under ``key``), the
    optimizer, the loop's counters and the generator that draws the CE positions."""
    return {key: {k: v.detach().clone() for k, v in model.state_dict().items() if keep(k)},
            "opt": opt.state_dict(), "st": run.as_dict(), "ce_generator": gen.get_state()}


def load_tensors_state(model: torch.nn.Module, key: str, opt, gen: torch.Generator, saved: dict) -> RunState:
    """Restores what :func:`tensors_state` saved under ``key``; returns the loop's counters."""
    model.load_state_dict(saved[key], strict=False)
    opt.load_state_dict(saved["opt"])
    if "ce_generator" in saved:  # a checkpoint written before it was kept starts the positions anew
        gen.set_state(saved["ce_generator"])
    return RunState(**saved["st"])


def method_defaults(args, *, lr: float, ce, steps: int) -> None:
    """Fills the options whose default depends on --method (None on the command line); ``ce`` keeps its
    default's type (a float, or lora's per-tier string)."""
    args.lr = lr if args.lr is None else args.lr
    args.ce = ce if args.ce is None else type(ce)(args.ce)
    args.steps = steps if args.steps is None else args.steps


def say(msg: str) -> None:
    """The loop's and the methods' log: stdout, flushed (a run's lines show as they happen)."""
    print(msg, flush=True)


def trim_log(path: Path, upto: int | None) -> None:
    """Keeps the JSONL records of ``path`` up to step ``upto`` (None: none of them)."""
    if not path.exists():
        return
    keep = [] if upto is None else [x for x in path.read_text().splitlines()
                                    if x.strip() and json.loads(x)["step"] <= upto]
    path.write_text("".join(x + "\n" for x in keep))


class Trainer:
    """Runs a :class:`Method` under :class:`Options` and a :class:`Budget`."""

    def __init__(self, method: Method, opts: Options, budget: Budget, log=say):
        self.method, self.opts, self.budget, self.log = method, opts, budget, log
        self.out = Path(opts.out)
        self.state = RunState()
        self.eval_s = 0.0  # the last evaluation's seconds: the budget keeps as much for the final one

    def run(self) -> int:
        o, st = self.opts, self.state
        torch.set_num_threads(o.threads)
        torch.manual_seed(o.seed)
        (self.out / "state").mkdir(parents=True, exist_ok=True)
        resuming = o.resume and (self.out / STATE).exists()
        self.method.prepare(resuming)
        if resuming:
            st = self.state = self._load()
        for name in (STEP_LOG, EVAL_LOG):
            trim_log(self.out / name, st.step if resuming else None)
        if o.eval_every and st.best is None:
            self._evaluate()
        reason = self._train()
        if o.eval_every and st.history[-1]["step"] != st.step:
            self._evaluate()
        self._save()
        where = f"best held-out at step {st.best['step']} exported" if o.eval_every else "exported"
        self.log(f"stopped at step {st.step}: {reason}. Trained {st.tokens:,} tokens at "
                 f"{st.tokens_per_s():.0f} tokens/s; {where} to {self.out}; wall {self.budget.minutes():.2f} min")
        return 0

    def _train(self) -> str:
        """Steps until the step budget, the time budget or the patience ends them; why they ended."""
        m, o, st, clock = self.method, self.opts, self.state, self.budget
        first = st.step
        last = min(m.total, first + o.stop_after) if o.stop_after else m.total
        bar = progress(total=m.total, initial=st.step, desc=o.desc, unit="step", mininterval=o.bar_interval)
        period = o.save_every_min * 60
        last_save = last_line = clock.now()
        try:
            while st.step < last:
                if clock.spent(self.eval_s + o.reserve_s):
                    total = m.on_budget(st.step)
                    if total is None:
                        return "--max-minutes reached" + (
                            " (time kept for the last evaluation and the export)" if o.eval_every else "")
                    clock.lift()
                    last, bar.total = min(last, total), total
                    continue
                s = self._step()
                bar.set_postfix_str(f"{st.tokens_per_s():.0f} tok/s {s.losses}", refresh=False)
                bar.update(1)
                now = clock.now()
                if st.step == first + 1 or (period and now - last_line >= period):
                    self.log(f"step {st.step} tokens {st.tokens} {st.tokens_per_s():.0f} tok/s {s.losses}")
                    last_line = now
                if o.eval_every and st.step % o.eval_every == 0:
                    self._evaluate()
                    self._save()
                    last_save = clock.now()
                    if o.patience and st.bad_evals >= o.patience:
                        return f"no held-out improvement in {o.patience} evaluations"
                elif period and now - last_save >= period:
                    self._save()
                    last_save = now
        finally:
            bar.close()
        return f"all {m.total} steps done" if st.step >= m.total else f"--stop-after {o.stop_after} reached"

    def _step(self) -> StepResult:
        st = self.state
        batch = self.method.batch(st.step)
        t0 = time.perf_counter()
        s = self.method.step(st.step, batch)
        st.step += 1
        st.tokens += s.tokens
        st.train_s += time.perf_counter() - t0
        if s.record is not None:
            rec = {"step": st.step, "tokens": st.tokens, **s.record, "train_s": round(st.train_s, 1)}
            with (self.out / STEP_LOG).open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return s

    def _evaluate(self) -> None:
        """Scores the held-out set, logs it, and exports when it is the best so far."""
        st, t0 = self.state, self.budget.now()
        ev = self.method.evaluate()
        ev.record = {"step": st.step, "tokens": st.tokens, "train_minutes": round(st.train_s / 60, 2),
                     **ev.metrics}
        st.history.append(ev.record)
        with (self.out / EVAL_LOG).open("a") as f:
            f.write(json.dumps(ev.record) + "\n")
        self.log("eval " + " ".join(f"{k}={v}" for k, v in ev.record.items()))
        if st.best is None or ev.score < st.best["score"] - BETTER_BY:
            st.best, st.bad_evals = {"score": ev.score, "step": st.step, "eval": ev.detail}, 0
            self.method.export(st, ev)
        else:
            st.bad_evals += 1
        self.eval_s = self.budget.now() - t0

    def _save(self) -> None:
        path = self.out / STATE
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.method.state_dict(self.state), tmp)
        tmp.replace(path)
        if not self.opts.eval_every:
            self.method.export(self.state, None)

    def _load(self) -> RunState:
        saved = torch.load(self.out / STATE, map_location="cpu", weights_only=False)
        st = self.method.load_state_dict(saved)
        self.log(f"resumed at step {st.step} ({st.tokens} tokens, {st.train_s / 60:.1f} min trained)")
        return st
