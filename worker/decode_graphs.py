"""CUDA graphs of the all-decode segments (``--compile`` on CUDA: the lean decode step on a GPU).

A decode step of a small model on a GPU is bound by kernel launches, not by bytes: SmolLM2-135M's 30
layers are ~300 launches of a few microseconds each against ~20 us of HBM time for its int4 weights.
As vLLM does, the launches of a step are recorded once per batch-size bucket and replayed as one graph.

What is captured, per segment ``s`` and bucket ``B`` (:data:`BUCKETS`): the segment's trunk layers
(:meth:`NestedModel._layer` with the Triton ops: norms, q/k/v, rotary, the KV write, paged attention,
o_proj, MLP) over ``B`` decode rows, reading its inputs from static buffers and writing h and the
residual to static outputs. "Piecewise", as vLLM's piecewise graphs: the embedding, the stored trunk
state, the exits (blocks and norms) and the LM head stay eager between the segments' graphs, because a
step's rows leave at different exits and a graph per tier mix would multiply the graphs. A step whose
segment has a row of more than one token (prefill, verification) or more rows than the largest bucket
runs that segment eagerly.

Padding rows (``R`` real rows in bucket ``B``): slot -1 (the KV write skips a negative slot:
kernels/kv_write_triton.py), context length 0 (the attention sees no key and writes zeros, the split
merge divides by 1), position 0. Rows never mix in any op of a layer, so padding cannot change a real
row's values -- but a different bucket may pick different matmul tiles than an eager step of ``R``
rows, so a row's logits can differ in the last bits from the eager path's (as with the CPU's compiled
graphs: each token event names the path that computed it, worker/execution.py).

The attention's split count is fixed when a graph is recorded: the kernel finds each row's chunk from its
own length on the device, so any split count is exact, and no host value of the step enters the graph.
Each bucket has two graphs, by the step's longest context: below ``2 * MIN_SPLIT_TOKENS`` the split count
the eager path picks there (one), else the one it picks for the longest context the model serves.

Graphs are recorded for every (segment, bucket, context class) when the path that holds them is applied
over a runner's KV pools (:meth:`DecodeGraphs.capture_all`, from ``worker.execution.CudaGraphDecode.apply``:
at the runner's construction, at a swap, first thing in ``warm_up``), largest bucket first, from padding rows alone -- so no request's state
is touched -- each after two eager warm-up runs on one side stream (Triton compiles then), all into one
memory pool; nothing allocated inside a graph outlives it (outputs are copied to the static buffers), so
replaying them in any order is safe. They hold the addresses of the KV pools (keyed by address, shape
and dtype), of the weights and of the rotary table: a step over other pools drops them and records what
it needs again, lazily, from its own rows; the weights must be final (quantized and fused: loading does
that) before ``worker.execution.compile_decode``. A step whose block table is wider than the model's longest context
needs (a pool of another block size) runs eagerly.

``capture=False`` runs the same static-buffer body without recording it (the CPU tests, with the Triton
kernels in the interpreter): everything above except the recording is exercised there.
"""
from __future__ import annotations

import contextlib
from bisect import bisect_left
from dataclasses import dataclass

import structlog
import torch

from kernels.paged_attention_triton import MIN_SPLIT_TOKENS
from worker.batch import SegmentTensors

log = structlog.get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


@dataclass(slots=True)
class _Static:
    """One segment's static inputs and outputs, sized for the largest bucket."""
    h: torch.Tensor            # [B, H]
    residual: torch.Tensor     # [B, H]
    positions: torch.Tensor    # [B] long
    slots: torch.Tensor        # [B] long, -1 on padding rows
    block_tables: torch.Tensor  # [B, max_blocks] long
    q_start_loc: torch.Tensor  # [B + 1] long: 0..B, every row one query
    ctx_lens: torch.Tensor     # [B] long, 0 on padding rows
    out_h: torch.Tensor
    out_residual: torch.Tensor


class DecodeGraphs:
    def __init__(self, model, max_rows: int = BUCKETS[-1], capture: bool | None = None):
        """``model``: a NestedModel on the Triton ops; ``max_rows``: the largest bucket (steps with more
        decode rows run eagerly); ``capture``: record CUDA graphs (default: when the model is on CUDA)."""
        if model.ops.name != "triton":
            raise ValueError(f"decode graphs need the triton ops (this model runs {model.ops.name!r})")
        dev = model.embed_tokens.weight.device
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on CUDA, it is on {dev}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.model = model
        self.device = dev
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)
        # the context each class's graphs are planned for: the eager path's one split below 2 * MIN_SPLIT_TOKENS
        short = min(2 * MIN_SPLIT_TOKENS - 1, model.max_positions)
        self.plan_ctx = {True: short, False: model.max_positions}
        self._pools_key: tuple | None = None
        self._static: dict[int, _Static] = {}
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph | None] = {}
        self._pool = None
        self._stream = None  # one side stream for every recording's warm-up (created with the first)
        self.replays = 0   # steps' segments served by a graph (tests, logs)
        self.captured = 0

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` decode rows; None past the largest."""
        i = bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(self, s: int, h: torch.Tensor, residual: torch.Tensor | None, pos: torch.Tensor,
            seg: SegmentTensors, kv) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Segment ``s``'s trunk layers over ``R`` decode rows (row r is token r) through the bucket's
        graph: (h, residual) [R, H], views of the segment's static outputs, valid until the segment's
        next replay. None when no bucket holds the rows (the caller runs them eagerly)."""
        R = h.shape[0]
        B = self.bucket(R)
        if B is None:
            return None
        self._bind(kv)
        st = self._static.get(s)
        if st is None:
            st = self._static[s] = self._alloc(kv, s)
        if seg.block_tables.shape[1] > st.block_tables.shape[1]:
            return None
        with self._on_device():
            self._fill(st, R, B, h, residual, pos, seg)
            key = (s, B, max(seg.ctx_lens_host) <= self.plan_ctx[True])
            if key not in self._graphs:
                self._graphs[key] = self._record(key, st, kv)
            g = self._graphs[key]
            if g is None:
                self._body(key, st, kv)
            else:
                g.replay()
        self.replays += 1
        return st.out_h[:R], st.out_residual[:R]

    @staticmethod
    def _fill(st: _Static, R: int, B: int, h, residual, pos, seg) -> None:
        """The step's R rows into the static inputs, rows R..B-1 padding."""
        st.h[:R].copy_(h)
        if residual is None:  # the model's first layer: h + 0 is h, so the graph of the others serves it
            st.residual[:R].zero_()
        else:
            st.residual[:R].copy_(residual)
        st.positions[:R].copy_(pos)
        st.positions[R:B].zero_()
        st.slots[:R].copy_(seg.slot_mapping)
        st.slots[R:B].fill_(-1)
        st.block_tables[:R, :seg.block_tables.shape[1]].copy_(seg.block_tables)
        st.ctx_lens[:R].copy_(seg.ctx_lens)
        st.ctx_lens[R:B].zero_()

    @torch.inference_mode()  # as the steps run: the Triton ops take their autograd fallback otherwise
    def capture_all(self, kv) -> int:
        """Records every (segment, bucket) over ``kv``'s pools from padding rows alone (no KV written);
        returns how many were recorded. Nothing to record without ``capture``."""
        if not self.capture:
            return 0
        self._bind(kv)
        n = 0
        with self._on_device():
            for s in range(self.model.num_segments):
                st = self._static.get(s)
                if st is None:
                    st = self._static[s] = self._alloc(kv, s)
                st.positions.zero_()
                st.slots.fill_(-1)
                st.ctx_lens.zero_()
                for B in reversed(self.buckets):  # largest first: the smaller ones fit in its pool
                    for short in (False, True):
                        if (s, B, short) not in self._graphs:
                            self._graphs[(s, B, short)] = self._record((s, B, short), st, kv)
                            n += 1
        if n:
            log.info("decode graphs recorded", graphs=n, segments=self.model.num_segments, buckets=self.buckets)
        return n

    # ---- internals ---------------------------------------------------------------------------
    def _on_device(self):
        """CUDA work on the model's device (graphs and their side stream belong to one device)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _bind(self, kv) -> None:
        """Graphs hold the pools' addresses (a freed pool's address may come back for another, so its
        shape and dtype are part of the key): other pools, other graphs."""
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (*kv.k, *kv.v))
        if key != self._pools_key:
            if self._graphs:
                log.info("decode graphs dropped: a step over other KV pools", graphs=len(self._graphs))
            self._graphs.clear()
            self._static.clear()
            self._pool = None
            self._pools_key = key

    def _alloc(self, kv, s: int) -> _Static:
        m = self.model
        B, H = self.buckets[-1], m.cfg.hidden_size
        dev, dt = m.embed_tokens.weight.device, m.embed_tokens.weight.dtype
        max_blocks = -(-m.max_positions // kv.k[s].shape[2])

        def longs(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.long, device=dev)

        return _Static(h=torch.zeros(B, H, dtype=dt, device=dev), residual=torch.zeros(B, H, dtype=dt, device=dev),
                       positions=longs(B), slots=longs(B, fill=-1), block_tables=longs(B, max_blocks),
                       q_start_loc=torch.arange(B + 1, device=dev), ctx_lens=longs(B),
                       out_h=torch.zeros(B, H, dtype=dt, device=dev),
                       out_residual=torch.zeros(B, H, dtype=dt, device=dev))

    def _body(self, key: tuple[int, int, bool], st: _Static, kv) -> None:
        """The segment's layers over the bucket's B rows of the static buffers (key: segment, bucket,
        short context)."""
        m = self.model
        s, B, short = key
        seg = SegmentTensors(num_rows=B, num_tokens=B, token_index=None, enter_index=None, enter_slots=None,
                             slot_mapping=st.slots[:B], block_tables=st.block_tables[:B],
                             q_start_loc=st.q_start_loc[:B + 1], ctx_lens=st.ctx_lens[:B],
                             q_lens_host=[1] * B, ctx_lens_host=[self.plan_ctx[short]] * B)  # plans only
        h, residual, pos = st.h[:B], st.residual[:B], st.positions[:B]
        k_cache, v_cache = kv.k[s], kv.v[s]
        for j, li in enumerate(m.segment_layers(s)):
            h, residual = m._layer(m.layers[li], h, residual, pos, seg, k_cache[j], v_cache[j])
        st.out_h[:B].copy_(h)
        st.out_residual[:B].copy_(residual)

    def _record(self, key: tuple[int, int, bool], st: _Static, kv):
        """Records (s, B); None without capture. The static inputs hold padding rows (capture_all) or a
        step's rows, whose KV the warm-up runs write once more each (the same values: a decode row's K/V
        depend on its own token and position only), so recording needs no scratch state."""
        if not self.capture:
            return None
        if self._stream is None:  # one: cuBLAS keeps a workspace per stream it has run on
            self._stream = torch.cuda.Stream(device=self.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles outside the recording
                self._body(key, st, kv)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._body(key, st, kv)
        self._pool = g.pool()
        self.captured += 1
        log.debug("decode graph recorded", segment=key[0], bucket=key[1], short_context=key[2],
                  graphs=self.captured)
        return g


__all__ = ["BUCKETS", "DecodeGraphs"]
