"""The nested model's serving forward (:class:`StepForward`, a part of :class:`worker.model.NestedModel`):
one group-batched step over the tier-segmented paged KV cache.

The rows are ordered by tier, highest first (worker/batch.py), so after segment ``s`` the rows of tier
``s`` are a contiguous tail of the batch: they leave it and are projected through their exit (its block,
its norm); the rest go on. In the general layout (some rows enter past segment 0: cross-tier catch-up)
each segment gathers its active tokens from the whole batch and scatters them back. The model's execution
path (worker/execution.py) may run a segment's trunk layers and an exit block another way (its answer
None: the eager layers below), and says which LM head module runs (``NestedModel.head``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.batch import StepTensors
    from worker.kv_tensors import SegmentedKVCache
    from worker.model import DecoderLayer


class StepForward:
    """The serving forward's methods; the model supplies the layers, exits, head, ops and the pieces its
    architecture adds (worker/layer_parts.py)."""

    @torch.inference_mode()
    def forward_step(self, batch: "StepTensors", kv: "SegmentedKVCache") -> torch.Tensor:
        """Runs one step of the group batch; returns logits [n_sampled_rows, V] in row order."""
        if batch.general:
            return self._forward_indexed(batch, kv)
        h = self.embed(batch.input_ids)
        residual = None
        exits: list[torch.Tensor] = []
        for s in range(self.num_segments):
            seg = batch.segments[s]
            if seg.num_tokens == 0:
                break
            if h.shape[0] != seg.num_tokens:  # rows of lower tiers have left at earlier exits
                h, residual = h[:seg.num_tokens], residual[:seg.num_tokens]
            pos = batch.positions[:seg.num_tokens]
            h, residual = self._segment(s, h, residual, pos, seg, kv)
            self._exit(s, h, residual, pos, seg, kv, batch.exit_token_index[s], exits, batch.exits[s])
        return self._logits(exits, batch)

    def _forward_indexed(self, batch: "StepTensors", kv: "SegmentedKVCache") -> torch.Tensor:
        """The general layout: some rows enter past segment 0 (cross-tier catch-up), so each segment
        gathers its active tokens from the whole batch and scatters them back."""
        H = self.embed(batch.input_ids)
        R = torch.zeros_like(H)
        exits: list[torch.Tensor] = []
        for s in range(self.num_segments):
            seg, ex = batch.segments[s], batch.exits[s]
            if seg.num_tokens == 0:
                if ex is not None and ex.seg is not None:  # exit fills alone
                    self._exit(s, H[:0], R[:0], batch.positions[:0], seg, kv, None, exits, ex)
                continue
            if seg.enter_index is not None:  # these tokens start here, from the stored hidden state
                prev = kv.hid[s - 1]
                stored = prev.view(-1, prev.shape[-1]).index_select(0, seg.enter_slots)
                H.index_copy_(0, seg.enter_index, stored)
                R.index_fill_(0, seg.enter_index, 0.0)
            idx = seg.token_index
            pos = batch.positions.index_select(0, idx)
            h, residual = self._segment(s, H.index_select(0, idx), R.index_select(0, idx), pos, seg, kv)
            H.index_copy_(0, idx, h)
            R.index_copy_(0, idx, residual)
            rows = batch.exit_token_index[s]
            if rows is not None and (ex is None or self.exit_block(s) is None):  # batch positions ->
                # positions among this segment's tokens (an exit block's own come with `ex`)
                local = torch.empty(H.shape[0], dtype=torch.long, device=H.device)
                local[idx] = torch.arange(idx.numel(), device=H.device)
                rows = local.index_select(0, rows)
            self._exit(s, h, residual, pos, seg, kv, rows, exits, ex)
        return self._logits(exits, batch)

    def _layer(self, layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor | None,
               pos: torch.Tensor, seg, k_cache: torch.Tensor, v_cache: torch.Tensor,
               rows: torch.Tensor | None = None, kv_only: bool = False):
        """One decoder layer over paged KV: writes the tokens' K/V, attends, and runs the MLP (for
        ``rows`` only when given; nothing past the KV write with ``kv_only``)."""
        cfg, ops = self.cfg, self.ops
        hn, residual = self._add_norm(h, residual, layer.input_layernorm)
        T = hn.shape[0]
        q, k, v = self._qk_norm(layer, *layer.qkv(hn))
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        q, k = self._rotary(layer, q, k, pos, seg.memo)
        ops.write_kv(k, v, k_cache, v_cache, seg.slot_mapping)
        if kv_only:
            return None, None
        a = self._attention(layer, q, k_cache, v_cache, seg)
        h = self._norm(layer.o_proj(a.view(T, -1)), layer.attn_out_norm)
        if rows is not None:
            h, residual = h.index_select(0, rows), residual.index_select(0, rows)
        hn, residual = self._add_norm(h, residual, layer.post_attention_layernorm)
        return self._norm(layer.mlp(hn, self.ops.silu_mul), layer.mlp_out_norm), residual

    def _segment(self, s: int, h: torch.Tensor, residual: torch.Tensor | None, pos: torch.Tensor,
                 seg, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk layers of segment s over its active tokens; stores their hidden state after the
        segment for later cross-tier reuse (every segment but the last)."""
        k_cache, v_cache = kv.k[s], kv.v[s]
        decode = self.execution is not None and h.shape[0] == len(seg.q_lens_host)  # every row one token
        out = self.execution.segment(self, s, h, residual, pos, seg, kv) if decode else None
        if out is not None:
            h, residual = out
        else:
            for j, li in enumerate(self.segment_layers(s)):
                h, residual = self._layer(self.layers[li], h, residual, pos, seg, k_cache[j], v_cache[j])
        if s < len(kv.hid):
            hid = kv.hid[s]
            hid.view(-1, hid.shape[-1]).index_copy_(0, seg.slot_mapping, (h + residual).to(hid.dtype))
        return h, residual

    def _exit(self, s: int, h: torch.Tensor, residual: torch.Tensor, pos: torch.Tensor, seg, kv,
              rows: torch.Tensor | None, exits: list[torch.Tensor], ex=None) -> None:
        """Rows of tier s that sample leave here: their tokens through exit s (its block, its norm).
        An exit block writes its KV for every token of the segment whose request reads it — all of
        them, or those ``ex`` (worker/batch.py: ExitTensors) selects, with exit fills entering from
        the stored trunk state; its attention output and MLP are only computed where needed (all
        block layers but the last, and the sampled rows of the last)."""
        blk = self.exit_block(s)
        if blk is not None and ex is not None:
            if ex.seg is None:
                return  # no token of this step reads exit s
            h, residual = self._exit_inputs(s, h, residual, kv, ex)
            pos, seg, rows = ex.positions, ex.seg, ex.rows
        if blk is not None:
            nl = len(self.segment_layers(s))
            k_cache, v_cache = kv.k[s], kv.v[s]
            decode = self.execution is not None and rows is not None and h.shape[0] == len(seg.q_lens_host)
            out = self.execution.exit_block(self, s, blk, h, residual, pos, seg, kv) if decode else None
            if out is not None:  # all decode rows, some sampled: the block's last MLP ran for every row
                h, residual = out[0].index_select(0, rows), out[1].index_select(0, rows)
            else:
                for j, layer in enumerate(blk):
                    last = j == len(blk) - 1
                    h, residual = self._layer(layer, h, residual, pos, seg, k_cache[nl + j], v_cache[nl + j],
                                              rows if last else None, kv_only=last and rows is None)
            if rows is None:
                return
            e, _ = self.ops.fused_add_rms_norm(h, residual, self.exit_norms[s], self.cfg.rms_eps)
            exits.append(e)
        elif rows is not None:
            e, _ = self.ops.fused_add_rms_norm(h.index_select(0, rows), residual.index_select(0, rows),
                                               self.exit_norms[s], self.cfg.rms_eps)
            exits.append(e)

    @staticmethod
    def _exit_inputs(s: int, h: torch.Tensor, residual: torch.Tensor, kv, ex) -> tuple[torch.Tensor, torch.Tensor]:
        """The exit's tokens' (h, residual): taken from the segment's, and for exit fills the stored
        trunk state with a zero residual (the block's first norm adds the two)."""
        if ex.tail_from is not None:
            return h[ex.tail_from:], residual[ex.tail_from:]
        if ex.enter_slots is None:
            return h.index_select(0, ex.take), residual.index_select(0, ex.take)
        H = h.new_zeros((ex.seg.num_tokens, h.shape[-1]))
        R = torch.zeros_like(H)
        if ex.take is not None:
            H.index_copy_(0, ex.take_to, h.index_select(0, ex.take))
            R.index_copy_(0, ex.take_to, residual.index_select(0, ex.take))
        hid = kv.hid[s]
        H.index_copy_(0, ex.enter_to, hid.view(-1, hid.shape[-1]).index_select(0, ex.enter_slots).to(H.dtype))
        return H, R

    def _logits(self, exits: list[torch.Tensor], batch: "StepTensors") -> torch.Tensor:
        if not exits:
            return self.embed_tokens.weight.new_empty((0, self.cfg.vocab_size))
        # exit order (lowest tier first) -> row order on the hidden states, not on the [rows, vocab] logits:
        # our int8/w4a8 heads compute each row alone (the same bits); torch's fp32 matmul may round a row
        # differently at another place in the batch (~1e-6)
        return self.softcap(self.head()(torch.cat(exits).index_select(0, batch.exit_to_row_order)))
