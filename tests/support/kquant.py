"""GGUF block bytes for tests: simple, correct quantizers of fp32 rows into Q4_K, Q5_K and Q6_K (not
llama.cpp's searches: a per-sub-block range, then the super-block scales rounded as the format stores
them), gguf-py's own quantizer for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, and random valid blocks."""
from __future__ import annotations

import numpy as np


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [n, 8] in 0..63 -> the 12 bytes Q4_K / Q5_K store them in (kquant_blocks.k_scales)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _k_with_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks x [n, 256] -> (d, dmin fp16 [n], sc, m uint8 [n, 8], q uint8 [n, 8, 32] in 0..levels)
    with x ~ (d * sc) * q - dmin * m."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(np.maximum((-lo).max(-1), 0) / 63)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(scale / df), 1, 63), 0).astype(np.uint8)
        m = np.where(mf > 0, np.clip(np.round(-lo / mf), 0, 63), 0).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.round((sub + (mf * m)[..., None]) / step), 0)
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_with_mins(x.reshape(-1, 256).astype(np.float32), 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low) and 2c + 1
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, m), qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_with_mins(x.reshape(-1, 256).astype(np.float32), 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):  # bit s of byte j: sub-block s's value j
        qh |= ((q[:, s] >> 4) & 1) << s
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, m), qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    g = x.reshape(-1, 16, 16).astype(np.float32)
    s = np.abs(g).max(-1) / 31
    d = _f16(s.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(s / df), -128, 127), 0).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.round(g / step), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.empty((q.shape[0], 128), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 64), dtype=np.uint8)
    for h in range(2):
        half = q[:, 128 * h:128 * (h + 1)]
        ql[:, 64 * h:64 * (h + 1)] = (half[:, 0:64] & 15) | ((half[:, 64:128] & 15) << 4)
        for t in range(4):
            qh[:, 32 * h:32 * (h + 1)] |= ((half[:, 32 * t:32 * (t + 1)] >> 4) & 3) << (2 * t)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """fp32 [N, K] -> the rows' block bytes uint8 [N, K / values * bytes] of ``kind``."""
    import gguf  # noqa: PLC0415
    w = np.ascontiguousarray(w, dtype=np.float32)
    own = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
    if kind in own:
        return own[kind](w).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def random_rows(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``k`` values in ``kind``'s blocks, with finite fp16 d (and dmin)."""
    from worker.formats.kquant_blocks import BLOCKS  # noqa: PLC0415
    values, size = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows * k // values, size), dtype=np.uint8)
    for pos in {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q5_1": (0, 2)}.get(kind, (0,)):  # d (and dmin)
        raw[:, pos:pos + 2] = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# a Q4_K_M-like mix: each linear kind of the llama layer in a block type of its own, one layer's
# exceptions (Q8_0, Q4_1, Q5_1), the embedding Q4_K and the output Q6_K
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_K",
       "ffn_up": "Q5_K", "ffn_down": "Q4_0"}
EXCEPTIONS = {"blk.3.ffn_down.weight": "Q8_0", "blk.2.attn_output.weight": "Q4_1", "blk.1.attn_output.weight": "Q5_1",
              "token_embd.weight": "Q4_K",
              "output.weight": "Q6_K"}


def mixed_kind(name: str) -> str | None:
    """The block kind :func:`tiny_kquant_llama` writes tensor ``name`` in (None: fp32, the norms)."""
    if name in EXCEPTIONS:
        return EXCEPTIONS[name]
    parts = name.split(".")
    return MIX.get(parts[2]) if parts[0] == "blk" else None


def tiny_kquant_llama(folder, layers: int = 4, seed: int = 0, tied: bool = False):
    """A tiny random Llama (hidden 256, intermediate 512: whole K-quant super-blocks; its head sharpened
    so greedy tokens vary) saved as a HF directory ``folder/hf`` and as ``folder/m.gguf`` with its
    tensors in :func:`mixed_kind`'s blocks (q/k rows permuted as llama.cpp's converter does). ``tied``:
    the head is the embedding, and the file holds it once, as Q6_K (a Q4_K_M's tied head)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from tests.support.factories import _spread_norms, write_gguf  # noqa: PLC0415
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg)
    _spread_norms(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(folder / "hf")
    kinds = (lambda name: "Q6_K" if name == "token_embd.weight" else mixed_kind(name)) if tied else mixed_kind
    return write_gguf(folder / "hf", folder / "m.gguf", kinds)
