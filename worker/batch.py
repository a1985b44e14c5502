"""Turning a step's rows into the tensors of one group-batched forward.

Rows are ordered by tier, highest first, so the rows still running in segment ``s`` (tier >= s) are a
prefix of the batch and the rows leaving at exit ``s`` are its tail. A row is the plan's own record
(core.protocol.PlanRow), whether it came over Redis or from the in-process engine.

An exit block runs over the tokens whose request reads it (:class:`ExitTensors`): the rows leaving
there, the crossing rows that write its KV (``PlanRow.exit_kv``), and exit fills (``exit_only`` rows,
which enter it from the trunk state stored at its boundary and run no trunk layer).
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
class ExitTensors:
    """The tokens of segment ``s``'s exit block when they are not simply all of the segment's."""
    seg: SegmentTensors | None        # their KV metadata in segment s's pool; None: no token runs it
    positions: torch.Tensor | None
    take: torch.Tensor | None         # indices, among the segment's active tokens, of those that run it
    take_to: torch.Tensor | None      # where they go among the exit's tokens (None: take is all of them)
    tail_from: int | None             # the exit's tokens are the segment's from here on (take unused)
    enter_slots: torch.Tensor | None  # exit fills: their slots in segment s's pool (stored trunk state)
    enter_to: torch.Tensor | None     # where they go among the exit's tokens
    rows: torch.Tensor | None         # the sampled tokens among the exit's tokens


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[SegmentTensors]
    exit_token_index: list[torch.Tensor | None]
    exit_to_row_order: torch.Tensor
    sampled_rows: list[int]  # indices (into the sorted rows) of the rows whose logits come back
    general: bool = False    # some row enters past segment 0: index the batch per segment
    exits: list[ExitTensors | None] = field(default_factory=list)  # per segment; None: every active token


def order_rows(rows: list[PlanRow]) -> list[int]:
    """Indices of rows sorted by tier, highest first (stable)."""
    return sorted(range(len(rows)), key=lambda i: -rows[i].tier)


def build_step(rows: list[PlanRow], num_segments: int, block_size: int,
               device: torch.device | str = "cpu", exit_blocks: tuple[int, ...] | None = None) -> StepTensors:
    """rows must already be sorted by tier, highest first (see :func:`order_rows`). `exit_blocks`: the
    segments whose exit has a block (None: any may), the only ones whose exit tokens are selected."""
    assert all(rows[i].tier >= rows[i + 1].tier for i in range(len(rows) - 1)), "rows not tier-sorted"
    lay = _Layout(rows, block_size, device)
    # Otherwise the active rows of a segment are a prefix (an exit fill runs no trunk layer).
    general = any(r.enter or r.exit_only for r in rows)
    segments = []
    exits: list[ExitTensors | None] = []
    exit_idx: list[torch.Tensor | None] = []
    exit_items: list[tuple[int, int]] = []  # (row, position within the row) per logit, exit order
    for s in range(num_segments):
        active = [i for i, r in enumerate(rows) if r.enter <= s <= r.tier and not r.exit_only]
        segments.append(lay.segment(s, active, general))
        leaving = [i for i in active if rows[i].tier == s
                   and (rows[i].sample or rows[i].sample_all or rows[i].logits_all)]
        exit_idx.append(lay.exit_index(active, leaving, general, exit_items))
        exits.append(_exit_tensors(lay, s, active, leaving) if exit_blocks is None or s in exit_blocks else None)
    sampled_items = sorted(exit_items)  # row order, then position
    where = {item: k for k, item in enumerate(exit_items)}
    return StepTensors(
        input_ids=lay.tensor([t for r in rows for t in r.token_ids]),
        positions=lay.tensor([p for r in rows for p in range(r.start_pos, r.start_pos + len(r.token_ids))]),
        segments=segments, exit_token_index=exit_idx,
        exit_to_row_order=lay.tensor([where[it] for it in sampled_items]),
        sampled_rows=[i for i, _ in sampled_items],
        general=general, exits=exits)


class _Layout:
    """A step's rows laid out as one batch: each row's tokens in row order, their lengths, context
    lengths and KV slots, and the tensors built from them."""

    def __init__(self, rows: list[PlanRow], block_size: int, device: torch.device | str):
        self.rows, self.block_size, self.device = rows, block_size, device
        self.q_lens = [len(r.token_ids) for r in rows]
        self.ctx = [r.start_pos + len(r.token_ids) for r in rows]
        self.starts = [0]  # row i's tokens are the batch's starts[i]..starts[i + 1] - 1
        for n in self.q_lens:
            self.starts.append(self.starts[-1] + n)

    def tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def slots_of(self, r: PlanRow, s: int) -> list[int]:
        """The KV slots of the row's tokens in segment s's pool."""
        table, bs = r.block_tables[s], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(r.start_pos, r.start_pos + len(r.token_ids))]

    def paged(self, s: int, which: list[int], **index) -> SegmentTensors:
        """The paged-KV metadata in segment s's pool of rows `which`, their tokens in that order."""
        rows, q_lens, ctx = self.rows, self.q_lens, self.ctx
        slots: list[int] = []
        max_b = max((len(rows[i].block_tables[s]) for i in which), default=1) or 1
        padded: list[list[int]] = []  # the rows' tables, zero-padded: one tensor built, not one a row
        qs = [0]
        for i in which:
            r, table = rows[i], rows[i].block_tables[s]
            assert len(table) >= -(-ctx[i] // self.block_size), f"row {i} segment {s}: too few blocks"
            padded.append([*table, *([0] * (max_b - len(table)))])
            slots.extend(self.slots_of(r, s))
            qs.append(qs[-1] + q_lens[i])
        bt = torch.tensor(padded, dtype=torch.long).view(len(which), max_b)
        return SegmentTensors(
            num_rows=len(which), num_tokens=qs[-1], token_index=index.get("token_index"),
            enter_index=index.get("enter_index"), enter_slots=index.get("enter_slots"),
            slot_mapping=self.tensor(slots), block_tables=bt.to(self.device), q_start_loc=self.tensor(qs),
            ctx_lens=self.tensor([ctx[i] for i in which]), q_lens_host=[q_lens[i] for i in which],
            ctx_lens_host=[ctx[i] for i in which])

    def segment(self, s: int, active: list[int], general: bool) -> SegmentTensors:
        """Segment s's tokens: the `active` rows'; in the general layout also where they sit in the batch,
        and the tokens entering here with the slots of their stored trunk state (segment s - 1's pool)."""
        token_index = enter_index = enter_slots = None
        if general:
            starts = self.starts
            token_index = self.tensor([t for i in active for t in range(starts[i], starts[i + 1])])
            entering = [i for i in active if self.rows[i].enter == s and s > 0]
            if entering:
                enter_index = self.tensor([t for i in entering for t in range(starts[i], starts[i + 1])])
                enter_slots = self.tensor([x for i in entering for x in self.slots_of(self.rows[i], s - 1)])
        return self.paged(s, active, token_index=token_index, enter_index=enter_index, enter_slots=enter_slots)

    def exit_index(self, active: list[int], leaving: list[int], general: bool,
                   exit_items: list[tuple[int, int]]) -> torch.Tensor | None:
        """The tokens the exit reads, each leaving row's last (every token for sample_all / logits_all):
        their indices among the segment's active tokens, or (in the general layout) in the whole batch;
        None when no row leaves. Appends (row, position) of each to ``exit_items``."""
        base = {i: self.starts[i] for i in active} if general else first_tokens(active, self.q_lens)
        idx: list[int] = []
        for i in leaving:
            js = sampled_positions(self.rows[i])
            exit_items.extend((i, j) for j in js)
            idx.extend(base[i] + j for j in js)
        return self.tensor(idx) if leaving else None


def first_tokens(which: list[int], q_lens: list[int]) -> dict[int, int]:
    """Row -> the index of its first token when the tokens of rows `which` are laid out in that order."""
    out, n = {}, 0
    for i in which:
        out[i] = n
        n += q_lens[i]
    return out


def sampled_positions(r: PlanRow) -> range:
    """The positions within a leaving row whose logits come back: its last, or all of them for a
    verification or prompt log-probabilities."""
    n = len(r.token_ids)
    return range(n) if r.sample_all or r.logits_all else range(n - 1, n)


def _exit_tensors(lay: _Layout, s: int, active: list[int], leaving: list[int]) -> ExitTensors | None:
    """Exit ``s``'s tokens: the active rows of tier s, the crossing rows whose ``exit_kv`` names s
    (every crossing row when it is None), and the exit fills of tier s. None when that is every active
    token (nothing to select: the common case without lazy exits)."""
    rows, q_lens, ltensor = lay.rows, lay.q_lens, lay.tensor
    runs = [i for i in active if rows[i].tier == s or rows[i].exit_kv is None or s in rows[i].exit_kv]
    fills = [i for i, r in enumerate(rows) if r.exit_only and r.tier == s]
    if not fills and len(runs) == len(active):
        return None
    if not runs and not fills:
        return ExitTensors(None, None, None, None, None, None, None, None)
    local = first_tokens(active, q_lens)  # among the segment's active tokens
    n = sum(q_lens[i] for i in active)
    order = sorted(runs + fills)
    start = first_tokens(order, q_lens)  # among the exit's tokens
    seg = lay.paged(s, order)
    pos = [p for i in order for p in range(rows[i].start_pos, rows[i].start_pos + q_lens[i])]
    take_idx = [local[i] + j for i in runs for j in range(q_lens[i])]
    tail_from = None
    if not fills and take_idx == list(range(n - len(take_idx), n)):
        tail_from = n - len(take_idx)  # the usual case: the tier's own rows, the segment's tail
    take = ltensor(take_idx) if runs and tail_from is None else None
    take_to = ltensor([start[i] + j for i in runs for j in range(q_lens[i])]) if take is not None and fills else None
    enter_slots = ltensor([x for i in fills for x in lay.slots_of(rows[i], s)]) if fills else None
    enter_to = ltensor([start[i] + j for i in fills for j in range(q_lens[i])]) if fills else None
    sampled = [start[i] + j for i in leaving for j in sampled_positions(rows[i])]
    return ExitTensors(seg, ltensor(pos), take, take_to, tail_from, enter_slots, enter_to,
                       ltensor(sampled) if sampled else None)
