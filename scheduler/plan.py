"""The one translation from a scheduled step to the rows a worker runs: the in-process engine
(engine/engine.py) executes them directly, the scheduler process (scheduler/service.py) sends them
in a StepPlan."""
from __future__ import annotations

from core import protocol as P
from scheduler.request import Request, ScheduledStep


def plan_rows(step: ScheduledStep) -> list[P.PlanRow]:
    """Every row of the step: plain rows (prefill chunks, decode), cross-tier catch-up rows, exit
    fills, and the rows of self-speculation."""
    def exit_kv(r: Request) -> list[int] | None:  # lazy exits: a row writes the lower exits it reads
        if not step.lazy_exits:
            return None
        return [] if r.params.spec_draft_tier is None else [r.params.spec_draft_tier]

    rows = [P.PlanRow(r.request_id, r.tier, r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n),
                      r.num_computed_tokens, r.block_tables, r.num_computed_tokens + n == r.num_tokens,
                      len(r.output_ids),
                      logits_all=r.params.prompt_logprobs is not None
                      and r.num_computed_tokens < len(r.prompt_ids) - 1 and not r.output_ids,
                      exit_kv=exit_kv(r))
            for r, n in step.rows]
    # Cross-tier catch-up rows: cached positions (or, after a cascade escalation, the history) whose
    # upper segments are computed this step.
    rows += [P.PlanRow(r.request_id, r.tier, r.token_slice(a, b), a, r.block_tables, False, len(r.output_ids),
                       enter=seg, exit_kv=exit_kv(r))
             for r, seg, a, b in step.catchups]
    # Exit fills: cached positions whose exit-block KV of tier `seg` a higher tier skipped.
    rows += [P.PlanRow(r.request_id, seg, r.token_slice(a, b), a, r.block_tables, False, len(r.output_ids),
                       enter=seg, exit_only=True)
             for r, seg, a, b in step.fills]
    # Self-speculation: draft rows run the draft tier's segments, verification rows the segments above
    # it from the hidden state the drafts stored at its exit, carrying the round's drafts (draft rows carry
    # the earlier drafts of their round when the runner needs them: penalties, a grammar).
    rows += [P.PlanRow(r.request_id, r.params.spec_draft_tier, [x], pos, r.block_tables, True,
                       len(r.output_ids), draft=True, exit_kv=exit_kv(r),
                       drafts=list(r.drafts) if r.params.penalized or r.params.grammar is not None else [])
             for r, x, pos in step.drafts]
    rows += [P.PlanRow(r.request_id, r.tier, toks, a, r.block_tables, False, len(r.output_ids),
                       enter=r.params.spec_draft_tier + 1, sample_all=True, drafts=r.drafts[:len(toks)],
                       exit_kv=exit_kv(r))
             for r, toks, a in step.verifies]
    return rows


def new_requests(step: ScheduledStep) -> list[P.NewRequest]:
    """What the worker must learn of the requests it sees for the first time in this step."""
    return [P.NewRequest(r.request_id, r.meta.get("gateway_id", ""), r.tier, len(r.prompt_ids), r.params,
                         sorted(r.stop_ids), r.num_cached_tokens, r.meta.get("seq_offset", 0),
                         list(r.prompt_ids) if r.params.needs_prompt else [])
            for r in step.new]


def build_plan(step: ScheduledStep, step_id: int, worker_started: str, epoch: int, steps: int = 1,
               stream_every: int = 1) -> P.StepPlan:
    return P.StepPlan(step_id, new=new_requests(step), rows=plan_rows(step), drop=step.drop,
                      worker_started=worker_started, epoch=epoch, steps=steps, stream_every=stream_every)
