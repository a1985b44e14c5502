"""The worker's side of a step: KV tensors, the group-batched forward, and sampling.

The runner holds no scheduling state. It is told which requests are new (their sampling parameters
and seeded generators live here, so a request samples the same sequence wherever it is batched),
which rows to compute, and which requests to forget.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.batch import RowInput, build_step, order_rows
from worker.kv_tensors import SegmentedKVCache
from worker.model import NestedModel
from worker.sampling import SamplingParams, make_generator, sample


@dataclass(slots=True)
class StepOutput:
    tokens: dict[str, int]
    logits: dict[str, torch.Tensor] | None
    num_tokens: int
    verified: dict[str, list[int]] = field(default_factory=dict)  # request -> target token per position


class ModelRunner:
    def __init__(self, model: NestedModel, num_blocks: list[int], block_size: int,
                 tier_map: dict[int, int] | None = None, keep_logits: bool = False):
        self.model = model
        cfg = model.cfg
        p = next(model.parameters())
        self.device = p.device
        self.kv = SegmentedKVCache([len(model.segment_layers(s)) for s in range(model.num_segments)],
                                   num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device,
                                   hidden_size=cfg.hidden_size if model.num_segments > 1 else 0)
        self.block_size = block_size
        self.tier_map = tier_map  # global tier -> this model's tier (a standalone copy has one)
        self.keep_logits = keep_logits
        self.sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self.sampling[request_id] = (params, make_generator(params))

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.sampling.pop(rid, None)

    def execute(self, rows: list[tuple[str, RowInput]]) -> StepOutput:
        if self.tier_map is not None:
            for _, r in rows:
                r.tier = self.tier_map[r.tier]
        order = order_rows([r for _, r in rows])
        rows = [rows[i] for i in order]
        batch = build_step([r for _, r in rows], self.model.num_segments, self.block_size, self.device)
        logits = self.model.forward_step(batch, self.kv)
        tokens: dict[str, int] = {}
        verified: dict[str, list[int]] = {}
        keep: dict[str, torch.Tensor] = {}
        plain = [k for k, i in enumerate(batch.sampled_rows) if not rows[i][1].sample_all]
        for k, i in enumerate(batch.sampled_rows):  # verification rows: the target's greedy choices
            if rows[i][1].sample_all:
                verified.setdefault(rows[i][0], []).append(int(torch.argmax(logits[k])))
        rids = [rows[batch.sampled_rows[k]][0] for k in plain]
        states = [self.sampling[rid] for rid in rids]
        sub = logits.index_select(0, torch.tensor(plain, dtype=torch.long, device=logits.device))
        toks = sample(sub, [st[0] for st in states], [st[1] for st in states])
        tokens.update(zip(rids, toks))
        if self.keep_logits:
            keep = {rid: sub[k].clone() for k, rid in enumerate(rids)}
        return StepOutput(tokens, keep if self.keep_logits else None, int(batch.input_ids.shape[0]),
                          verified)
