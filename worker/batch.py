"""Turning a step's rows into the tensors of one group-batched forward.

Rows are ordered by tier, highest first, so the rows still running in segment ``s`` (tier >= s) are a
prefix of the batch and the rows leaving at exit ``s`` are its tail.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowInput:
    tier: int
    token_ids: list[int]          # tokens computed this step
    start_pos: int                # tokens of this row already in the cache
    block_tables: list[list[int]]  # one per segment 0..tier
    sample: bool                  # the row's last token is its newest: sample the next


@dataclass(slots=True)
class SegmentTensors:
    num_rows: int
    num_tokens: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    q_start_loc: torch.Tensor
    ctx_lens: torch.Tensor
    q_lens_host: list[int]
    ctx_lens_host: list[int]


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[SegmentTensors]
    exit_token_index: list[torch.Tensor | None]
    exit_to_row_order: torch.Tensor
    sampled_rows: list[int]  # indices (into the sorted rows) of the rows whose logits come back


def order_rows(rows: list[RowInput]) -> list[int]:
    """Indices of rows sorted by tier, highest first (stable)."""
    return sorted(range(len(rows)), key=lambda i: -rows[i].tier)


def build_step(rows: list[RowInput], num_segments: int, block_size: int,
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

    segments = []
    exit_idx: list[torch.Tensor | None] = []
    exit_rows: list[int] = []
    for s in range(num_segments):
        nr = sum(1 for r in rows if r.tier >= s)
        nt = starts[nr]
        slots: list[int] = []
        max_b = max((len(r.block_tables[s]) for r in rows[:nr]), default=1) or 1
        bt = torch.zeros((nr, max_b), dtype=torch.long)
        for i, r in enumerate(rows[:nr]):
            table = r.block_tables[s]
            need = -(-ctx[i] // block_size)
            assert len(table) >= need, f"row {i} segment {s}: {len(table)} blocks < {need} needed"
            if table:
                bt[i, :len(table)] = torch.tensor(table, dtype=torch.long)
            for p in range(r.start_pos, ctx[i]):
                slots.append(table[p // block_size] * block_size + p % block_size)
        segments.append(SegmentTensors(
            num_rows=nr, num_tokens=nt,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=bt.to(device),
            q_start_loc=torch.tensor(starts[:nr + 1], dtype=torch.long, device=device),
            ctx_lens=torch.tensor(ctx[:nr], dtype=torch.long, device=device),
            q_lens_host=q_lens[:nr], ctx_lens_host=ctx[:nr]))
        leaving = [i for i, r in enumerate(rows[:nr]) if r.tier == s and r.sample]
        exit_rows.extend(leaving)
        exit_idx.append(torch.tensor([starts[i + 1] - 1 for i in leaving], dtype=torch.long,
                                     device=device) if leaving else None)
    sampled = sorted(exit_rows)  # row order
    where = {row: k for k, row in enumerate(exit_rows)}
    return StepTensors(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        segments=segments, exit_token_index=exit_idx,
        exit_to_row_order=torch.tensor([where[r] for r in sampled], dtype=torch.long, device=device),
        sampled_rows=sampled)
