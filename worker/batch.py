"""Turning a step's rows into the tensors of one group-batched forward.

Rows are ordered by tier, highest first, so the rows still running in segment ``s`` (tier >= s) are a
prefix of the batch and the rows leaving at exit ``s`` are its tail. A row is the plan's own record
(core.protocol.PlanRow), whether it came over Redis or from the in-process engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.protocol import PlanRow


@dataclass(slots=True)
class SegmentTensors:
    num_rows: int
    num_tokens: int
    token_index: torch.Tensor | None  # batch positions of the active tokens; None: the first num_tokens
    enter_index: torch.Tensor | None  # batch positions of tokens entering here from stored hidden
    enter_slots: torch.Tensor | None  # their slots in the previous segment's pool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    q_start_loc: torch.Tensor
    ctx_lens: torch.Tensor
    q_lens_host: list[int]
    ctx_lens_host: list[int]
    memo: dict = field(default_factory=dict)  # index tensors the torch ops reuse across its layers


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[SegmentTensors]
    exit_token_index: list[torch.Tensor | None]
    exit_to_row_order: torch.Tensor
    sampled_rows: list[int]  # indices (into the sorted rows) of the rows whose logits come back
    general: bool = False    # some row enters past segment 0: index the batch per segment


def order_rows(rows: list[PlanRow]) -> list[int]:
    """Indices of rows sorted by tier, highest first (stable)."""
    return sorted(range(len(rows)), key=lambda i: -rows[i].tier)


def build_step(rows: list[PlanRow], num_segments: int, block_size: int,
               device: torch.device | str = "cpu") -> StepTensors:
    """rows must already be sorted by tier, highest first (see :func:`order_rows`)."""
    assert all(rows[i].tier >= rows[i + 1].tier for i in range(len(rows) - 1)), "rows not tier-sorted"
    ids: list[int] = []
    pos: list[int] = []
    q_lens = [len(r.token_ids) for r in rows]
    ctx = [r.start_pos + len(r.token_ids) for r in rows]
    for r in rows:
        ids.extend(r.token_ids)
        pos.extend(range(r.start_pos, r.start_pos + len(r.token_ids)))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)

    def slots_of(r: PlanRow, s: int) -> list[int]:
        table = r.block_tables[s]
        return [table[p // block_size] * block_size + p % block_size
                for p in range(r.start_pos, r.start_pos + len(r.token_ids))]

    def ltensor(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=device)

    general = any(r.enter for r in rows)  # otherwise the active rows of a segment are a prefix
    segments = []
    exit_idx: list[torch.Tensor | None] = []
    exit_items: list[tuple[int, int]] = []  # (row, position within the row) per logit, exit order
    for s in range(num_segments):
        active = [i for i, r in enumerate(rows) if r.enter <= s <= r.tier]
        slots: list[int] = []
        max_b = max((len(rows[i].block_tables[s]) for i in active), default=1) or 1
        bt = torch.zeros((len(active), max_b), dtype=torch.long)
        qs = [0]
        for k, i in enumerate(active):
            r, table = rows[i], rows[i].block_tables[s]
            assert len(table) >= -(-ctx[i] // block_size), f"row {i} segment {s}: too few blocks"
            if table:
                bt[k, :len(table)] = torch.tensor(table, dtype=torch.long)
            slots.extend(slots_of(r, s))
            qs.append(qs[-1] + q_lens[i])
        token_index = enter_index = enter_slots = None
        if general:
            token_index = ltensor([t for i in active for t in range(starts[i], starts[i + 1])])
            entering = [i for i in active if rows[i].enter == s and s > 0]
            if entering:
                enter_index = ltensor([t for i in entering for t in range(starts[i], starts[i + 1])])
                enter_slots = ltensor([x for i in entering for x in slots_of(rows[i], s - 1)])
        segments.append(SegmentTensors(
            num_rows=len(active), num_tokens=qs[-1], token_index=token_index, enter_index=enter_index,
            enter_slots=enter_slots, slot_mapping=ltensor(slots), block_tables=bt.to(device),
            q_start_loc=ltensor(qs), ctx_lens=ltensor([ctx[i] for i in active]),
            q_lens_host=[q_lens[i] for i in active], ctx_lens_host=[ctx[i] for i in active]))
        leaving = [i for i in active if rows[i].tier == s
                   and (rows[i].sample or rows[i].sample_all or rows[i].logits_all)]
        # The exit reads the row's last token (every token for sample_all / logits_all): its index
        # among the segment's active tokens, or (in the general layout) in the whole batch.
        base = {i: (starts[i] if general else qs[k]) for k, i in enumerate(active)}
        idx: list[int] = []
        for i in leaving:
            js = range(q_lens[i]) if rows[i].sample_all or rows[i].logits_all else [q_lens[i] - 1]
            exit_items.extend((i, j) for j in js)
            idx.extend(base[i] + j for j in js)
        exit_idx.append(ltensor(idx) if leaving else None)
    sampled_items = sorted(exit_items)  # row order, then position
    where = {item: k for k, item in enumerate(exit_items)}
    return StepTensors(
        input_ids=ltensor(ids), positions=ltensor(pos), segments=segments, exit_token_index=exit_idx,
        exit_to_row_order=ltensor([where[it] for it in sampled_items]),
        sampled_rows=[i for i, _ in sampled_items],
        general=general)
