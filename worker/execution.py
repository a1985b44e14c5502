"""Execution paths of the nested model's decode steps, applied from outside the model (as gpt-fast
compiles its decode function around a plain model).

:class:`worker.model.NestedModel` has one eager forward. Its serving forward asks ``model.execution``
(None: eager) to run three things another way, and runs them eagerly where the path answers None:

* ``segment(model, s, h, residual, pos, seg, kv)`` -- a segment's trunk layers over all-decode rows;
* ``exit_block(model, s, blk, h, residual, pos, seg, kv)`` -- a tier's exit block over all-decode rows
  (the caller takes the sampled rows after it);
* ``head(model)`` -- the LM head module every step runs (the model's own, or the path's copy of it on
  another kernel: the model's head object is never changed).

A path owns its lifecycle: ``apply(model, kv)`` makes it the model's path from the next step on and,
where its graphs hold the addresses of a runner's KV pools (CUDA graphs), records them over ``kv`` there,
before any request waits; the path holds what it built. Nothing but ``model.execution`` changes, so a
shallow copy of the model is a shadow to build a path on while the model serves eagerly
(worker/background_compile.py).

Three paths, one picked per model at load (:func:`pick`):

* ``eager`` -- the model's own layers, op by op;
* ``inductor`` -- CPU, the torch ops: each segment's layers as one inductor graph, and on AVX-512 an
  int8 LM head compiled in fp32 (:mod:`worker.compiled_step`); ``inductor-trunk`` is the same with every
  exit block eager (a serving worker's first swap, while the exit blocks' graphs build);
* ``cuda-graphs`` -- CUDA, the Triton ops: CUDA graphs per batch-size bucket (:mod:`worker.decode_graphs`).

The compiled paths' results may round differently from the eager ops' in the last bits (fused
elementwise work), so a token can differ where two logits nearly tie: a serving worker says which path
computed each token (``TokenEvent.path``, the response's ``mfs.paths``).
"""
from __future__ import annotations

import copy
import shutil
from typing import TYPE_CHECKING

import torch

from core.protocol import EXECUTION_PATHS
from worker.compiled_step import compiled_decode_segment, compiled_head_kernel, layer_signature, write_segment_kv
from worker.formats import compile_refusal, rows_kernel_head, uncompilable, ungraphable

if TYPE_CHECKING:
    from worker.model import NestedModel

# INDUCTOR_TRUNK: inductor's graphs for the trunk's segments while the exit blocks' are still building (a
# serving worker swaps it in first, worker/background_compile.py); exit blocks run eagerly under it
EAGER, INDUCTOR_TRUNK, INDUCTOR, CUDA_GRAPHS = EXECUTION_PATHS


def path_name(model: "NestedModel") -> str:
    """The path the model's decode steps take now."""
    return EAGER if model.execution is None else model.execution.name


def compiled_path(model: "NestedModel") -> str:
    """The compiled path this model would take (ValueError where none serves it): inductor on CPU with
    the torch ops, CUDA graphs on CUDA with the Triton ops."""
    device = model.embed_tokens.weight.device
    if not model.cfg.llama_layers:  # the compiled layers are Llama's (worker/compiled_step.py)
        raise ValueError(f"the compiled decode layers are Llama's; {model.cfg.model_type}'s run eager")
    if model.ops.name == "triton" and device.type == "cuda":
        stuck = ungraphable(model)  # the weight formats say what a CUDA graph cannot capture
        if stuck:
            raise ValueError(f"--compile: CUDA graphs cannot capture {', '.join(stuck)}")
        return CUDA_GRAPHS
    if model.ops.name != "torch" or device.type != "cpu":
        raise ValueError(f"--compile is for the torch ops on CPU or the triton ops on CUDA (ops "
                         f"{model.ops.name}, device {device})")
    stuck = uncompilable(model)  # e.g. w8a8: fbgemm's packed linears break the graph (measured ~2x slower)
    if stuck:
        raise ValueError(compile_refusal(stuck))
    return INDUCTOR


def compile_decode(model: "NestedModel", enable: bool = True) -> None:
    """All-decode steps through the model's compiled path (:func:`compiled_path`); ``enable=False``:
    back to eager. Graphs build lazily, on the first steps that need them (a serving worker builds them
    in the background first: worker/background_compile.py)."""
    eager(model)
    if not enable:
        return
    if compiled_path(model) == CUDA_GRAPHS:
        from worker.decode_graphs import DecodeGraphs  # noqa: PLC0415
        use_decode_graphs(model, DecodeGraphs(model))
    else:
        InductorDecode(model).apply(model)


def eager(model: "NestedModel") -> None:
    """The model's decode steps back on its eager layers (a path changes nothing else on the model)."""
    model.execution = None


def use_decode_graphs(model: "NestedModel", graphs) -> None:
    """All-decode segments through ``graphs`` (a :class:`worker.decode_graphs.DecodeGraphs` of this
    model; None: eager). compile_decode() on CUDA sets one; tests set one that does not capture."""
    if graphs is not None and graphs.model is not model:
        raise ValueError("these decode graphs belong to another model")
    eager(model)
    if graphs is not None:
        CudaGraphDecode(graphs).apply(model)


def decode_graphs(model: "NestedModel"):
    """The model's CUDA decode graphs, or None."""
    return model.execution.graphs if isinstance(model.execution, CudaGraphDecode) else None


def compiled_exits(model: "NestedModel") -> frozenset[int]:
    """The segments whose exit block an all-decode step runs through the compiled graph (inductor; blocks
    built as the trunk's layers)."""
    return model.execution.exits if isinstance(model.execution, InductorDecode) else frozenset()


class CudaGraphDecode:
    """CUDA graphs of the all-decode segments (worker/decode_graphs.py), held here and recorded over a
    runner's KV pools when the path is applied there; exit blocks and the head stay eager."""
    name = CUDA_GRAPHS

    def __init__(self, graphs):
        self.graphs = graphs

    def segment(self, model, s, h, residual, pos, seg, kv):
        return self.graphs.run(s, h, residual, pos, seg, kv)

    def exit_block(self, model, s, blk, h, residual, pos, seg, kv):
        return None

    def head(self, model):
        return model.lm_head

    def apply(self, model, kv=None) -> None:
        """The model's all-decode segments through these graphs from its next step on. ``kv`` (a runner's
        KV pools): every (segment, bucket) graph recorded over them now, largest first; None: recorded
        lazily by the steps that need them (a step over other pools records again the same way)."""
        if self.graphs.model is not model:
            raise ValueError("these decode graphs belong to another model")
        model.execution = self
        if kv is not None:
            self.graphs.capture_all(kv)


class InductorDecode:
    """Each segment's trunk layers as one inductor graph over decode rows (worker/compiled_step.py),
    exit blocks built as the trunk's layers through graphs of a second compiled function, and the int8
    head's compiled kernel where it pays (:func:`worker.compiled_step.compiled_head_kernel`)."""
    def __init__(self, model: "NestedModel"):
        self.graph = compiled_decode_segment(model.cfg, list(model.layers))
        # an exit block whose layers are built as the trunk's (same modules, parameter shapes and dtypes)
        # runs through a graph of its own length; any other stays eager. The exit blocks' graphs are a
        # second compiled function (its own dynamo cache): a worker builds them on one thread while another
        # serves the trunk's (worker/background_compile.py)
        trunk = layer_signature(model.layers[0])
        self.exits = frozenset(int(k) for k, blk in model.exit_blocks.items()
                               if all(layer_signature(layer) == trunk for layer in blk))
        self.exit_graph = compiled_decode_segment(model.cfg, list(model.layers)) if self.exits else None
        self.name = INDUCTOR
        # an int8 head (worker/formats/int8.py: Int8Linear) where its scheme takes a compiled kernel; AVX-512
        # only. The path runs its own copy of the head module on it (the tensors shared): the model's head
        # keeps its kernel, so a worker builds this path while it serves eagerly.
        self.head_kernel = compiled_head_kernel() if rows_kernel_head(model) else None
        self.head_of = model.lm_head
        self._head = None if self.head_kernel is None else _on_kernel(model.lm_head, self.head_kernel)

    def trunk_only(self) -> "InductorDecode":
        """This path with every exit block eager (``inductor-trunk``), sharing its graphs and head."""
        out = copy.copy(self)
        out.exits, out.name = frozenset(), INDUCTOR_TRUNK
        return out

    def apply(self, model, kv=None) -> None:
        """The model's all-decode steps (and every step's head) through this path from its next step on.
        ``kv``, a runner's KV pools, asks nothing of this path: its graphs are dynamic in the pools' size
        and address, so none is recorded for them."""
        if model.lm_head is not self.head_of:
            raise ValueError("this path was built for another model (its LM head differs)")
        model.execution = self

    def head(self, model):
        return model.lm_head if self._head is None else self._head

    def segment(self, model, s, h, residual, pos, seg, kv):
        if residual is None:  # the model's first layer: h + 0 is h, so one graph serves it too
            residual = torch.zeros_like(h)
        layers = tuple(model.layers[li] for li in model.segment_layers(s))
        return self.layers(model, layers, h, residual, pos, seg, kv.k[s], kv.v[s], 0)

    def exit_block(self, model, s, blk, h, residual, pos, seg, kv):
        if s not in self.exits:
            return None
        # its last layer's MLP for every row, then the caller takes the sampled ones (each row's values
        # are its own)
        return self.layers(model, tuple(blk), h, residual, pos, seg, kv.k[s], kv.v[s],
                           len(model.segment_layers(s)), self.exit_graph)

    def layers(self, model, layers: tuple, h, residual, pos, seg, k_cache, v_cache, first_kv: int,
               graph=None):
        """``layers`` over decode rows (one token each) as the compiled graph, their KV layers
        ``first_kv`` on in the pools; writes the rows' new K/V. ``graph``: the compiled function (the
        segments' by default)."""
        # dynamo guards on how an input was made (a view or not, its offset, an inference tensor or not):
        # an exit's rows (the segment's tail, positions built with the step) and a segment's (a prefix of
        # the batch) arrive either way, so each is copied here, made alike -- a few rows' copy instead of
        # a recompile in a client's step
        h, residual, pos = h.clone(), residual.clone(), pos.clone()
        kp = k_cache.view(k_cache.shape[0], -1, *k_cache.shape[3:])[first_kv:]
        vp = v_cache.view(v_cache.shape[0], -1, *v_cache.shape[3:])[first_kv:]
        # the rows' context slots are computed in the graph (compiled_step.decode_slots) from their block
        # tables and lengths, copied like the rows above; a table one block wide gets its column twice (the
        # graph reads only the first), so its width never takes the size 1 dynamo specializes a graph on
        bt = seg.block_tables
        bt = bt.expand(-1, 2).contiguous() if bt.shape[1] == 1 else bt.clone()
        h, residual, ks, vs = (graph or self.graph)(layers, h, residual, pos, model.cos_sin, kp, vp, bt,
                                         seg.ctx_lens.clone(), max(seg.ctx_lens_host), k_cache.shape[2])
        write_segment_kv(kp, vp, seg.slot_mapping, ks, vs)
        return h, residual


def _on_kernel(head, kernel):
    """A copy of the LM head module, its tensors shared, that runs ``kernel`` (its ``rows_kernel``)."""
    out = copy.copy(head)
    out.rows_kernel = kernel
    return out


COMPILE_CHOICES = ("auto", "on", "off")


def choose(model: "NestedModel", compile: str) -> tuple[str, str]:
    """The path a serving worker takes, and why: (path, reason). ``compile``: ``off`` eager; ``on`` the
    model's compiled path (ValueError where none serves it: the flag is never ignored); ``auto`` the
    compiled path where one serves the model and it can build (a C++ compiler for inductor), else eager."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"--compile {compile!r}: expected one of {', '.join(COMPILE_CHOICES)}")
    if compile == "off":
        return EAGER, "compiled decode off (--compile off; mfs up --no-compile)"
    try:
        path = compiled_path(model)
    except ValueError as e:
        if compile == "on":
            raise
        return EAGER, f"no compiled path for this model: {e}"
    if path == INDUCTOR and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        if compile == "on":
            raise ValueError("--compile: inductor needs a C++ compiler (g++): install one or run without --compile")
        return EAGER, "no C++ compiler for inductor"
    return path, "compiled decode is the default where it builds (--no-compile opts out)" \
        if compile == "auto" else "--compile"
