"""GGUF's quantized blocks: rows read from a GGUF file (Q4_1 and Q8_0 parsed here; Q4_0, Q5_0 and the
K-quants as raw rows, dequantized by worker/formats/kquant_blocks.py) and matched to the loaded model's
tensors, so a scheme can take the file's own blocks (no second rounding) where the model still holds
exactly their dequantized values."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from family.gguffile import GGUFFile
from worker.formats.kquant_blocks import BLOCKS, dequantize
from worker.formats.scheme import GGUF_BLOCK

_Q4_1_BYTES, _Q8_0_BYTES = 20, 34
_LAYER_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
assert _Q8_0_BYTES == 2 + GGUF_BLOCK and _Q4_1_BYTES == 4 + GGUF_BLOCK // 2


def q4_1_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, G * 20] bytes -> q [N, K] uint8 (0..15), d [N, G] and m [N, G] fp32;
    w = d * q + m. A block: fp16 d, fp16 m, 16 bytes holding values j (low nibble) and j + 16 (high)."""
    N = raw.shape[0]
    G = raw.shape[1] // _Q4_1_BYTES
    dm = raw.view(torch.int16).view(N, G, _Q4_1_BYTES // 2)[..., :2].contiguous().view(torch.float16).float()
    qs = raw.view(N, G, _Q4_1_BYTES)[..., 4:]
    q = torch.empty(N, G, 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, :, 1])
    return q.view(N, G * GGUF_BLOCK), dm[..., 0].contiguous(), dm[..., 1].contiguous()


def q8_0_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows [N, G * 34] bytes -> q [N, K] int8 and d [N, G] fp32; w = d * q."""
    N = raw.shape[0]
    b = raw.view(N, -1, _Q8_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    q = b[..., 2:].contiguous().view(torch.int8).reshape(N, -1)
    return q, d


def dequant_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    N, G = d.shape
    return torch.addcmul(m[..., None], q.view(N, G, -1), d[..., None]).view(N, -1)


def dequant_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    return (d[..., None] * q.view(N, d.shape[1], -1).float()).view(N, -1)


@dataclass(slots=True)
class GGUFTensor:
    kind: str  # "Q4_1", "Q8_0" or a kind of kquant_blocks.BLOCKS
    raw: torch.Tensor  # [rows, bytes per row] uint8


class GGUFSource:
    """The quantized tensors of one GGUF file, by name (its index read by :class:`family.gguffile.GGUFFile`)."""

    def __init__(self, path: str):
        self.path = path
        self.tensors: dict[str, GGUFTensor] = {}
        for t in GGUFFile(path).tensors:
            if t.kind in ("Q4_1", *BLOCKS):
                self.tensors[t.name] = GGUFTensor(t.kind, torch.from_numpy(t.data.copy()))

    def blocks(self, gguf_name: str, like: torch.Tensor, kinds: tuple[str, ...] | None = None):
        """(kind, row permutation, blocks) when tensor ``gguf_name`` (of one of ``kinds``; None: any)
        dequantizes exactly to ``like`` up to an order of rows (llama.cpp stores q/k rows permuted for
        its rotary layout), else None. blocks: Q4_1's (q, d, m), Q8_0's (q, d), the other kinds' raw rows.
        A file without ``output.weight`` ties its head to ``token_embd.weight``: that one is looked up."""
        t = self.tensors.get(gguf_name)
        if t is None and gguf_name == "output.weight":
            t = self.tensors.get("token_embd.weight")
        if t is None or t.raw.shape[0] != like.shape[0] or (kinds is not None and t.kind not in kinds):
            return None
        if t.kind == "Q4_1":
            blocks = q4_1_blocks(t.raw)
            deq = dequant_q4_1(*blocks)
        elif t.kind == "Q8_0":
            blocks = q8_0_blocks(t.raw)
            deq = dequant_q8_0(*blocks)
        else:
            blocks, deq = t.raw, dequantize(t.raw, t.kind)
        if deq.shape != like.shape:
            return None
        perm = match_rows(deq, like.detach().float().cpu())
        return None if perm is None else (t.kind, perm, blocks)


def match_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor | None:
    """perm with src[perm] == dst bit for bit, or None (rows matched by a hash of their bits, then checked)."""
    if torch.equal(src, dst):
        return torch.arange(src.shape[0])
    coef = torch.randint(1, 2**31, (src.shape[1],), generator=torch.Generator().manual_seed(0))
    ks = (src.view(torch.int32).long() * coef).sum(1)
    kd = (dst.view(torch.int32).long() * coef).sum(1)
    ss, si = ks.sort()
    if ss.unique().numel() != ss.numel():
        return None
    pos = torch.searchsorted(ss, kd).clamp_(max=ss.numel() - 1)
    perm = si[pos]
    return perm if torch.equal(src[perm], dst) else None


def gguf_name(module_name: str) -> str | None:
    """The GGUF tensor that holds a model module's weight (llama.cpp's names), or None."""
    parts = module_name.split(".")
    if module_name == "embed_tokens":
        return "token_embd.weight"
    if module_name == "lm_head":
        return "output.weight"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


__all__ = ["GGUFSource", "GGUFTensor", "dequant_q4_1", "dequant_q8_0", "gguf_name", "match_rows", "q4_1_blocks",
           "q8_0_blocks"]
