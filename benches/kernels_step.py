"""`mfs bench kernels`, the decode step (CUDA): one step at batch 1 of a random-weight model -- the ~1B
Llama and the default family's base shape (SmolLM2-135M, top tier; its exit blocks are not in it) --
with each kernel backend, the Triton one also through CUDA graphs (worker/decode_graphs.py), against
the memory-bandwidth floor: the bytes of weights and KV a step reads over ``--bandwidth``; then the
same model with int4 weights as CUDA serves them (the Triton dequantize-matmul), eager and graphed,
against the floor of its own bytes. tests/test_decode_graphs.py builds these models on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benches.kernels_common import EPS, LLAMA_1B, SERVE, SHAPES, Timer


def _random_llama(ops, device: str = "cuda", shape: dict = LLAMA_1B, tied: bool = False,
                  theta: float = 500000.0):
    """A bf16 NestedModel of ``shape`` (LLAMA_1B) with random weights, built on ``device``; ``tied``:
    the head is the embedding (SmolLM2's)."""
    from worker.config import ModelConfig  # noqa: PLC0415
    from worker.model import NestedModel, Tier, skeleton  # noqa: PLC0415
    s = shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, s["head_dim"], 2).float() / s["head_dim"]))
    cfg = ModelConfig(model_type="llama", rms_eps=EPS, max_position=8192, tie_embeddings=tied,
                      inv_freq=inv_freq, **s)
    with skeleton():
        model = NestedModel(cfg, [Tier(0, "full", s["num_layers"])], ops=ops)
    model = model.to(torch.bfloat16).to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:  # norm weights
                p.fill_(1.0)
    model.rebuild_buffers()
    return model.eval()


@dataclass(slots=True)
class _KV:
    """The per-segment lists forward_step reads (one segment: no stored trunk state, ``hid`` empty)."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    hid: list[torch.Tensor] = field(default_factory=list)


def _decode_batch(model, ctx: int, block_size: int, device: str = "cuda"):
    from core.protocol import PlanRow  # noqa: PLC0415
    from worker.batch import build_step  # noqa: PLC0415
    cfg = model.cfg
    blocks = -(-ctx // block_size)
    shape = (cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = _KV([torch.randn(shape, device=device).to(torch.bfloat16)],
             [torch.randn(shape, device=device).to(torch.bfloat16)])
    row = PlanRow("r", tier=0, token_ids=[7], start_pos=ctx - 1, block_tables=[list(range(blocks))],
                  sample=True, num_output=0)
    return build_step([row], 1, block_size, device), kv


def _graphed_step(model, batch, kv, capture: bool | None = None):
    """The decode step through CUDA decode graphs (``--compile`` on CUDA: worker/decode_graphs.py), one
    bucket of one row, recorded before it is timed. Undo with ``use_decode_graphs(model, None)``."""
    from worker.decode_graphs import DecodeGraphs  # noqa: PLC0415
    from worker.execution import use_decode_graphs  # noqa: PLC0415
    graphs = DecodeGraphs(model, max_rows=1, capture=capture)
    graphs.capture_all(kv)
    use_decode_graphs(model, graphs)
    return lambda: model.forward_step(batch, kv)


def _floor_bytes(model, ctx: int) -> tuple[int, int]:
    """Bytes a decode step must read: every weight but the embedding (one row of it; a tied head reads
    all of it: named_parameters lists the shared tensor once, as the head's or the embedding's), and
    the KV."""
    head_w = getattr(model.lm_head, "weight", None)  # quantized: the head has a tensor of its own
    tied = head_w is not None and head_w is getattr(model.embed_tokens, "weight", None)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if tied or not n.startswith("embed_tokens"))
    cfg = model.cfg
    kv = 2 * ctx * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    return weights, kv


def time_decode_steps(timer: Timer, ctx: int, bandwidth: float, device: str = "cuda",
                      shapes: dict | None = None) -> dict:
    """The batch-1 decode step of each of SHAPES (the 1B Llama and the default family's base).
    (``device``/``shapes``: tests run the same code on the CPU, tiny, graphs not captured.)"""
    return {name: time_decode_step(timer, ctx, bandwidth, name, device, shapes or SHAPES)
            for name in (shapes or SHAPES)}


def time_decode_step(timer: Timer, ctx: int, bandwidth: float, name: str = "1b", device: str = "cuda",
                     shapes: dict | None = None) -> dict:
    """One of SHAPES: bf16 with each backend, Triton through CUDA graphs, then int4 (eager, graphed)."""
    from kernels import TORCH_OPS, select_backend  # noqa: PLC0415
    backends = {"torch": TORCH_OPS, "triton": select_backend("triton", device)}
    shapes = shapes or SHAPES
    shape, tied, theta = shapes[name]
    print(f"-- decode step, {name} shape", flush=True)
    model = _random_llama(TORCH_OPS, device, shape=shape, tied=tied, theta=theta)
    batch, kv = _decode_batch(model, ctx, SERVE.block_size, device)
    weights, kv_bytes = _floor_bytes(model, ctx)
    floor_ms = (weights + kv_bytes) / bandwidth * 1e3
    result = {"model": name, "shape": shape, "tied_head": tied, "dtype": "bfloat16", "batch": 1, "ctx": ctx,
              "weight_bytes": weights, "kv_bytes": kv_bytes, "bandwidth_Bps": bandwidth,
              "floor_ms": floor_ms}
    for backend, ops in backends.items():
        model.ops = ops
        ms = timer(lambda: model.forward_step(batch, kv))
        result[backend] = {"backend": ops.name, "step_ms": ms, "x_floor": ms / floor_ms}
        print(f"decode step ({ops.name}): {ms:.3f} ms, {ms / floor_ms:.1f}x the {floor_ms:.3f} ms "
              "bandwidth floor", flush=True)
    ms = timer(_graphed_step(model, batch, kv))  # model.ops is the triton backend's now
    from worker.execution import use_decode_graphs  # noqa: PLC0415
    use_decode_graphs(model, None)
    result["triton_graphs"] = {"backend": "triton", "cuda_graphs": True, "step_ms": ms, "x_floor": ms / floor_ms}
    print(f"decode step (triton, CUDA graphs): {ms:.3f} ms, {ms / floor_ms:.1f}x the {floor_ms:.3f} ms "
          "bandwidth floor", flush=True)
    del model, kv
    torch.cuda.empty_cache()
    result["int4"] = _time_int4_step(timer, ctx, bandwidth, name, device, shapes)
    return result


def _time_int4_step(timer: Timer, ctx: int, bandwidth: float, name: str = "1b", device: str = "cuda",
                    shapes: dict | None = None) -> dict:
    """The same model quantized as the family serves it on CUDA (``--weights int4``: 4-bit groups of
    32, 8-bit head, fp32 activations and KV), the Triton backend; its floor is its own bytes."""
    from kernels import select_backend  # noqa: PLC0415
    from worker.formats import quantize_model  # noqa: PLC0415
    shape, tied, theta = (shapes or SHAPES)[name]
    model = _random_llama(select_backend("triton", device), device, shape=shape, tied=tied, theta=theta).float()
    quantize_model(model, "int4", device=device, layout="groups")  # what CUDA serves, on any device
    batch, kv = _decode_batch(model, ctx, SERVE.block_size, device)
    kv.k, kv.v = [t.float() for t in kv.k], [t.float() for t in kv.v]
    weights, _ = _floor_bytes(model, ctx)
    kv_bytes = 2 * ctx * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4
    floor_ms = (weights + kv_bytes) / bandwidth * 1e3
    ms = timer(lambda: model.forward_step(batch, kv))
    print(f"decode step (int4 weights, triton): {ms:.3f} ms, {ms / floor_ms:.1f}x the {floor_ms:.3f} ms "
          "bandwidth floor", flush=True)
    graphs_ms = timer(_graphed_step(model, batch, kv))
    print(f"decode step (int4 weights, triton, CUDA graphs): {graphs_ms:.3f} ms, {graphs_ms / floor_ms:.1f}x "
          f"the {floor_ms:.3f} ms bandwidth floor", flush=True)
    del model, kv
    torch.cuda.empty_cache()
    return {"model": name, "weights": "int4", "activations": "float32", "weight_bytes": weights, "kv_bytes": kv_bytes,
            "floor_ms": floor_ms, "step_ms": ms, "x_floor": ms / floor_ms,
            "cuda_graphs": {"step_ms": graphs_ms, "x_floor": graphs_ms / floor_ms}}
