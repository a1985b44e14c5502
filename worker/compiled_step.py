"""The compiled decode layer for CPU serving (worker/execution.py's inductor path: the lean decode step).

When every row of a segment's step is a decode row (one new token each) and the torch ops serve, the
segment's trunk layers -- per layer its norms, q/k/v, rotary, the KV write, the attention (our
``mfs::decode_attention`` reading the context in place where it builds, kernels/cpu_attention.py; else a
gather and SDPA; each row's context slots computed in the graph from its block table, :func:`decode_slots`),
o_proj and MLP -- run as one ``torch.compile`` graph (inductor's C++ backend) instead of ~50 eager ops
and their Python per layer. One graph per segment, not per layer: dynamo's guard check and call cost
~60 us a call here, as much as a layer's fusions save. The layers' modules are inputs, so segments of
equal length share a graph; batch size and context length are dynamic (one recompile going from batch
1 to more). An exit block built as the trunk's layers runs through the same graph too (its own length,
its own graph; ``worker.execution.compiled_exits``) when its tokens are decode rows and some sample.
Prefill chunks, verification rows, mixed steps and exit fills stay eager (their trunk layers; the int8
head below is compiled in every step). A serving worker builds the graphs in the background while it
serves eagerly (worker/background_compile.py: ``ModelRunner.warm_up`` over a shadow of the model: the top
tier's, and each lower tier's whose block the graph serves), then swaps them in.

With ``--compile`` the int8 LM head (49152 x 576 for SmolLM2: 28 of the 101 MB an int4 step streams) also
runs compiled (:func:`int8_rows`): inductor's loop reads each weight row once and dots it with every
activation row in fp32, where torch's ``_weight_int8pack_mm`` rounds the activations to bf16. Measured
on SmolLM2's head (one thread): 2.1 vs 4.6 ms at one row, 3.6 vs 6.1 at two, about equal from 4 rows
up (16, 64 and 256 rows: 26.5/26.3, 102/113, 425/430 ms, neither tiles rows); errors ~1e-6 instead
of ~2e-2, and a row's logits are the same bit for bit at any batch size. That is on AVX-512: with
AVX2 inductor's loop loads the int8 weights eight at a time through ``Vectorized<int8_t>``'s partial
load (a copy through a buffer), and the compiled head runs 4x-18x *slower* than the bf16 kernel (two
threads, SmolLM2's head: 22.3 vs 5.2 ms at one row, 346 vs 19.3 ms at sixteen). So the compiled head
is taken only where torch reports AVX-512 (:func:`compiled_head_kernel`); elsewhere the int8 head
stays on ``_weight_int8pack_mm`` under ``--compile`` too.

Rounding: on fp32 the graph calls the eager layers' own operators for every step of a layer (the
norms, rotary, SiLU, attention: kernels/cpu_rows.py; the linears' kernels), so it computes what the
eager path computes, bit for bit; inductor only sequences them. Where those operators do not serve
(another dtype, ``MFS_NONDETERMINISTIC=1``) the graph fuses the torch references and may round
differently from the eager ops in the last bits; each token event names the path its step ran
(``TokenEvent.path``, the response's ``mfs.paths``).
"""
from __future__ import annotations

import itertools
import os
import types
from typing import Callable

import structlog
import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from kernels import cpu_rows
from kernels.cpu_attention import decode_attention_kernel
from kernels.cpu_gemv import int8_gemv_kernel
from kernels.paged_attention import gather_index
from kernels.rmsnorm import fused_add_rms_norm_torch
from kernels.rotary import rotary_torch

log = structlog.get_logger(__name__)


def make_decode_layer(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float):
    """One decoder layer for T decode rows (row r is token r): the eager ops' computation as one
    function to compile, except that it does not write the pool: the rows' new K/V are put into the
    gathered context at their positions (what the eager path reads back after writing them) and
    returned for the caller to write. The model's sizes are closed over, so they stay constants when
    the batch and context are dynamic. k_pool/v_pool [blocks * block_size, Hkv, D]; flat [T * lmax]
    slots; last [T] each row's new position in its context; mask [T, 1, 1, lmax]."""
    gqa = num_heads != num_kv_heads
    in_place = decode_attention_kernel() if head_dim % 16 == 0 else None
    per_row = cpu_rows.rows_kernel()  # the eager layers' operators (kernels/cpu_rows.py), decided before tracing

    def norm(h, residual, w):
        if not (per_row and h.dtype == torch.float32):
            return fused_add_rms_norm_torch(h, residual, w, eps)
        if residual is None:
            return torch.ops.mfs.rms_norm(h, w, eps), h
        return torch.ops.mfs.add_rms_norm(h, residual, w, eps)

    def decode_layer(layer, h, residual, pos, cos_sin, k_pool, v_pool, flat, last, mask):
        f32 = per_row and h.dtype == torch.float32
        hn, residual = norm(h, residual, layer.input_layernorm)
        q, k, v = layer.qkv(hn)
        T = hn.shape[0]
        q = q.reshape(T, num_heads, head_dim)
        k, v = k.reshape(T, num_kv_heads, head_dim), v.reshape(T, num_kv_heads, head_dim)
        q, k = torch.ops.mfs.rotary(q, k, pos, cos_sin) if f32 else rotary_torch(q, k, pos, cos_sin)
        k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)  # what the pool will hold
        if in_place is not None and k_pool.dtype == torch.float32 and q.dtype == torch.float32:
            # the context read where it lies in the pool, the new entry from k, v (kernels/cpu_attention.py)
            o = in_place(q, k_pool, v_pool, flat, last, k, v, scale)
            h = layer.o_proj(o.reshape(T, -1))
        else:
            rows = torch.arange(T, device=h.device)
            kk = k_pool.index_select(0, flat).view(T, -1, num_kv_heads, head_dim).index_put((rows, last), k)
            vv = v_pool.index_select(0, flat).view(T, -1, num_kv_heads, head_dim).index_put((rows, last), v)
            o = F.scaled_dot_product_attention(q.unsqueeze(2), kk.transpose(1, 2).to(q.dtype),
                                               vv.transpose(1, 2).to(q.dtype), attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
            h = layer.o_proj(o[:, :, 0].reshape(T, -1))
        hn, residual = norm(h, residual, layer.post_attention_layernorm)
        return layer.mlp(hn, torch.ops.mfs.silu_mul if f32 else None), residual, k, v

    return decode_layer


def decode_slots(block_tables, ctx_lens, lmax, block_size):
    """Each row's context as pool slots, padded to ``lmax``: (flat slots [T * lmax], mask [T, 1, 1, lmax],
    last [T], each row's new position). What ``kernels.paged_attention.decode_gather`` computes eagerly
    (the same :func:`~kernels.paged_attention.gather_index`), traced into the graph so its dozen small
    ops fuse there (a padding position reads slot 0; the attention never uses it)."""
    slots, valid = gather_index(block_tables, ctx_lens, block_size, lmax)
    return slots.reshape(-1), valid[:, None, None, :], ctx_lens - 1


def make_decode_segment(cfg):
    """A segment's trunk layers over decode rows: layer j reads KV layer j of the segment's pools
    ([kv layers, blocks * block_size, Hkv, D]), each row's context found through its block table
    ([T, max blocks]) and length ([T]; ``lmax`` the longest). Returns (h, residual, K, V) with
    K, V [layers, T, Hkv, D] the rows' new entries, for :func:`write_segment_kv`. (Writing them inside
    the graph would make inductor copy the whole pool: a mutated view of an input.)"""
    layer_fn = make_decode_layer(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps,
                                 cfg.head_dim ** -0.5)

    def decode_segment(layers: tuple, h, residual, pos, cos_sin, k_pool, v_pool, block_tables, ctx_lens,
                       lmax: int, block_size: int):
        flat, mask, last = decode_slots(block_tables, ctx_lens, lmax, block_size)
        ks, vs = [], []
        for j, layer in enumerate(layers):
            h, residual, k, v = layer_fn(layer, h, residual, pos, cos_sin, k_pool[j], v_pool[j], flat, last,
                                         mask)
            ks.append(k)
            vs.append(v)
        return h, residual, torch.stack(ks), torch.stack(vs)

    return decode_segment


def write_segment_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
                     ks: torch.Tensor, vs: torch.Tensor) -> None:
    """The rows' new K/V of a segment's first ``len(ks)`` KV layers into its pools, one op each."""
    n = ks.shape[0]
    k_pool[:n].index_copy_(1, slot_mapping, ks)
    v_pool[:n].index_copy_(1, slot_mapping, vs)


_instances = itertools.count()

# inductor's C++ wrapper: the graph's calls (its own kernels, the int4 matmuls, attention) are made
# from generated C++ instead of a generated Python function. `mfs bench step --model default-raw
# --weights int4 --batch 1,4 --threads 1 --compile`, alternated twice (the exit-block data stage
# beside): batch 1 16.0/15.9 -> 14.1/14.2 ms, batch 4 29.7/29.6 -> 28.7/28.8 ms.
CPU_OPTIONS = {"cpp_wrapper": True}


def layer_signature(layer) -> tuple:
    """What a compiled graph assumes of a layer: each submodule's name and type, each parameter's name,
    shape and dtype. Equal signatures, one graph."""
    return tuple((n, type(m).__name__) for n, m in layer.named_modules()) + tuple(
        (n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())


def stable_kernel_keys() -> None:
    """Inductor names each C++ kernel it builds by a hash of the kernel's source and its compile command.
    That command holds the absolute path of this install's torch (``-I.../site-packages/torch/include``,
    ``-L.../torch/lib``), so another install of the same torch (a second clone's .venv) finds none of the
    kernels in the shared cache ($MFS_CACHE/inductor) and builds every one again, each identical to a
    cached one. Here the key is hashed with that path written as torch's version: the same source, flags and
    torch find the kernel already built; another torch still builds its own. Only the key changes: the
    compile itself runs the real command. Once per process."""
    from torch._inductor import codecache  # noqa: PLC0415 (imports dynamo: only where a graph compiles)
    if getattr(codecache.write, "mfs_stable", False):
        return
    install, original = os.path.dirname(torch.__file__), codecache.write

    def write(content, extension, extra="", *args, **kwargs):
        return original(content, extension, extra.replace(install, f"<torch {torch.__version__}>"), *args,
                        **kwargs)
    write.mfs_stable = True
    codecache.write = write


def compiled_decode_segment(cfg, layers) -> Callable:
    """:func:`make_decode_segment` compiled (inductor, dynamic batch and context) for one model's
    trunk ``layers``: one graph, and one guard check, per segment and step. Guards on the layers'
    modules are skipped -- checking every parameter of ten layers costs more than the graph saves --
    which is sound because (a) every layer has the same signature (checked here: ValueError if not),
    (b) each call of this function compiles its own copy of the code, so dynamo's cache, which lives on
    the code object, is never shared with another model, and (c) the modules are final (quantization
    and fusion happen at load, before this). Tensor inputs' shapes stay guarded."""
    sigs = {layer_signature(layer) for layer in layers}
    if len(sigs) != 1:
        raise ValueError(f"--compile needs trunk layers of one structure; this model has {len(sigs)}")
    # no "duck" sizes: a dynamic size equal to another at the first trace (a block table two wide, two KV
    # heads; a context as long as the pools have layers) would become one symbol, and a later step where
    # they differ a recompile. (Process-wide; the other compiled function, the int8 head, has no such
    # pairs.)
    torch.fx.experimental._config.use_duck_shape = False
    fn = make_decode_segment(cfg)
    code = fn.__code__.replace(co_name=f"decode_segment_{next(_instances)}")
    fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    stable_kernel_keys()
    return torch.compile(fn, dynamic=True, options={
        **CPU_OPTIONS, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def int8_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scales[:, None]).T`` for x [M, K] fp32, q int8 [N, K], one scale per output row; as
    written for inductor: [N, M] with the K reduction innermost, so a weight row is read from memory
    once and stays in L1 for all M rows, then one transpose."""
    o = (q.unsqueeze(1).float() * x.unsqueeze(0)).sum(-1)
    return (o * scales.float()[:, None]).t()


_int8_rows_compiled: Callable | None = None


def compiled_int8_rows() -> Callable:
    """:func:`int8_rows` compiled once per process (dynamic shapes: every int8 head shares the graphs,
    one for a single row and one for more)."""
    global _int8_rows_compiled
    if _int8_rows_compiled is None:
        stable_kernel_keys()
        _int8_rows_compiled = torch.compile(int8_rows, dynamic=True, options=dict(CPU_OPTIONS))
    return _int8_rows_compiled


_head_choice_logged = False


def compiled_head_kernel() -> Callable | None:
    """The int8 head's kernel under ``--compile``: None where our int8 operator serves the int8 linears
    (:func:`kernels.cpu_gemv.int8_gemv_kernel`: on the AVX-512 machine it ran SmolLM2's head in 0.79 /
    1.45 / 3.0 / 11.9 ms at 1 / 2 / 6 / 16 rows against inductor's 1.34 / 2.73 / 6.9 / 15.0, so the
    head keeps the linears' own kernel); else :func:`compiled_int8_rows` where the CPU has AVX-512; else
    None (the bf16 ``_weight_int8pack_mm``; see the module's docstring for the AVX2 figures). Logged
    once per process."""
    global _head_choice_logged
    cap = torch.backends.cpu.get_cpu_capability()
    ours = int8_gemv_kernel() is not None
    kernel = compiled_int8_rows() if cap == "AVX512" and not ours else None
    if not _head_choice_logged:
        log.info("compiled int8 head", kernel="inductor fp32 rows" if kernel else "the int8 linears' own kernel",
                 cpu_capability=cap)
        _head_choice_logged = True
    return kernel


__all__ = ["make_decode_layer", "decode_slots", "make_decode_segment", "compiled_decode_segment", "layer_signature",
           "write_segment_kv", "int8_rows", "compiled_int8_rows", "compiled_head_kernel"]
