"""``--weights gguf`` (CPU with AVX2; AVX-512 VNNI used where present): every tensor in the block type the
GGUF file ships it in, its bytes kept as the file has them (super-block scales and mins included), times
activations quantized to 8 bits per 32 values. Owns the schemes of the K-quants and legacy kinds
(:class:`GGUFBlocksLinear`, one class per kind), the ones that pick a kind per tensor
(:class:`GGUFLinear`, :class:`GGUFHead`, :class:`GGUFEmbedding`), the format's declaration
(:data:`GGUF`, registered on import) and what ``--weights auto`` serves for a GGUF (:func:`served`).

Per tensor: Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks go to ``mfs::gguf_a8_gemv`` (kernels/cpu_kquant.cpp);
Q4_1 to w4a8's :class:`worker.formats.w4a8.Q4A8Linear` as shipped; a tensor the file does not hold as
blocks (an HF checkpoint, a delta, a new exit block) is packed as w4a8 packs it. A tied LM head takes the
file's ``token_embd`` blocks, and the embedding holds that very tensor (one copy, as llama.cpp keeps): a
lookup dequantizes its rows only, bit for bit the file's dequantized values."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from family.gguffile import GGUFFile
from kernels import cpu_kquant
from worker.formats.int8 import Int8A8Linear, Int8Embedding, Int8Linear
from worker.formats.kquant_blocks import BLOCKS, dequantize
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig
from worker.formats.w4a8 import Q4A8Linear
from worker.formats.weightformat import Layout, WeightFormat

KINDS = tuple(BLOCKS)  # the kinds our operator serves (Q4_1: w4a8's)


def _raw_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUFSource's parsed Q8_0 (q int8 [N, K], d fp32 [N, K / 32]) -> the file's rows [N, K / 32 * 34]."""
    N = q.shape[0]
    dh = d.half().contiguous().view(torch.uint8).view(N, -1, 2)
    return torch.cat([dh, q.contiguous().view(torch.uint8).view(N, -1, GGUF_BLOCK)], dim=-1).reshape(N, -1)


def found_raw(found) -> tuple[str, torch.Tensor] | None:
    """(kind, rows in the model's order) of a GGUF lookup holding one of :data:`KINDS`, else None."""
    if not found or found[0] not in KINDS:
        return None
    kind, perm, blocks = found
    raw = _raw_q8_0(*blocks) if kind == "Q8_0" else blocks
    if torch.equal(perm, torch.arange(raw.shape[0])):
        return kind, raw  # the source's tensor itself: a tied head and embedding then share one copy
    return kind, raw[perm].contiguous()


class GGUFBlocksLinear(Scheme):
    """y = x @ W.T + b with W the file's blocks of one kind, uint8 ``blocks`` [N, K / values * bytes] as
    the file's rows hold them, served by ``mfs::gguf_a8_gemv``. One subclass per kind."""
    backend, compilable = "cpu", False
    kind: ClassVar[str] = "?"
    row_tensors = ("blocks",)  # rows are independent: blocks of one kind concatenate by row

    def __init__(self, raw: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        values, size = BLOCKS[self.kind]
        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % size:
            raise ValueError(f"{self.kind} rows must be uint8 [N, a multiple of {size}], got {raw.dtype} "
                             f"{list(raw.shape)}")
        cpu_kquant.load()  # the operator forward calls (built once per machine, loaded once per process)
        self.out_features, self.in_features = raw.shape[0], raw.shape[1] // size * values
        self.blocks = nn.Parameter(raw.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mfs.gguf_a8_gemv(x.reshape(-1, shape[-1]).float().contiguous(), self.blocks,
                                       cpu_kquant.KINDS.index(self.kind))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.kind)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}"


# one scheme class per kind (a scheme's name and kind are class attributes), named as Q4_KLinear etc.
BLOCK_LINEARS: dict[str, type[GGUFBlocksLinear]] = {
    k: type(f"{k}Linear", (GGUFBlocksLinear,), {"name": f"gguf-{k.lower()}", "kind": k, "gguf_kinds": (k,),
                                                 "__module__": __name__, "__qualname__": f"{k}Linear"})
    for k in KINDS}


class GGUFLinear(Scheme):
    """Picks per tensor (never itself a module): the file's blocks of :data:`KINDS` as
    :class:`GGUFBlocksLinear`, its Q4_1 blocks or else the fp32 weights as w4a8's :class:`Q4A8Linear`."""
    # eager only: a Q4_K_M file's layers differ in kinds (more bits in some layers), and the compiled
    # decode step needs trunk layers of one structure (worker/compiled_step.py)
    name, gguf_kinds, compilable = "gguf", ("Q4_1", *KINDS), False

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Linear) and mod.in_features % GGUF_BLOCK == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        raw = found_raw(found)
        if raw is not None:
            return BLOCK_LINEARS[raw[0]](raw[1], mod.bias), True
        return cls.fallback(mod, found, cfg)

    @classmethod
    def fallback(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return Q4A8Linear.load(mod, found, cfg)


class GGUFHead(GGUFLinear):
    """The LM head: as :class:`GGUFLinear`, but a head the file does not hold as blocks is w4a8's
    (:class:`Int8A8Linear`, one int8 scale per row)."""
    name = "gguf-head"

    @classmethod
    def fallback(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        if found and found[0] == "Q4_1":
            return Q4A8Linear.load(mod, found, cfg)
        return Int8A8Linear.load(mod, found, cfg)


class GGUFEmbedding(Scheme):
    """The token embedding from the file's blocks of :data:`KINDS` other than Q8_0 (that one is
    :class:`Int8Embedding`, as every format serves it): uint8 ``blocks`` [V, H / values * bytes] as the
    file's rows hold them, the tied head's own tensor where the head takes the same rows. A lookup
    dequantizes its rows only (:func:`worker.formats.kquant_blocks.dequantize`): the file's values bit
    for bit. Without the file's blocks: :class:`Int8Embedding` from the fp32 weights."""
    name, backend, gguf_kinds, graphable = "gguf-embedding", "any", KINDS, True
    row_tensors = ("blocks",)

    def __init__(self, raw: torch.Tensor, kind: str):
        super().__init__()
        values, size = BLOCKS[kind]
        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % size:
            raise ValueError(f"{kind} rows must be uint8 [N, a multiple of {size}], got {raw.dtype} "
                             f"{list(raw.shape)}")
        self.kind = kind
        self.num_embeddings, self.embedding_dim = raw.shape[0], raw.shape[1] // size * values
        # what ``weight`` answers (the dtype and device lookups return): fp32, empty
        self.register_buffer("out_like", torch.zeros(0), persistent=False)
        self.blocks = nn.Parameter(raw.contiguous(), requires_grad=False)

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Embedding) and mod.embedding_dim % GGUF_BLOCK == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        raw = found_raw(found) if found and found[0] != "Q8_0" else None
        if raw is None:
            return Int8Embedding.load(mod, found, cfg)
        return cls(raw[1], raw[0]), True

    @classmethod
    def concat(cls, mods):
        return None  # an embedding is never fused

    def step_bytes(self) -> int:
        return 0  # a decode step reads its rows' few bytes, not the table

    @property
    def weight(self) -> torch.Tensor:
        """Only dtype and device are meaningful (model code allocates its outputs from them)."""
        return self.out_like

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks[ids.reshape(-1)], self.kind)
        return rows.view(*ids.shape, self.embedding_dim)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.kind)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"


FORMAT = WeightFormat("gguf", "each tensor in the block type its GGUF ships (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
                      "Q5_K, Q6_K; no second rounding) times activations quantized per 32; tensors the file does "
                      "not hold as blocks as w4a8 (what auto serves for a GGUF whose layers hold types beyond Q4_1)",
                      ("cpu",), "its kernels are for CPUs with AVX2",
                      {"cpu": Layout((GGUFLinear, Int8Linear), (GGUFHead, Int8Linear), (GGUFEmbedding,))},
                      group=GGUF_BLOCK, needs_cpu_operators=True, needs=cpu_kquant.load)
GGUF = FORMAT


def layer_kinds(source: str) -> set[str]:
    """The block kinds of a GGUF file's layer and output tensors (``blk.*``, ``output.weight``)."""
    return {t.kind for t in GGUFFile(source).tensors if t.name.startswith("blk.") or t.name == "output.weight"}


__all__ = ["BLOCK_LINEARS", "FORMAT", "GGUF", "GGUFBlocksLinear", "GGUFEmbedding", "GGUFHead", "GGUFLinear", "KINDS",
           "found_raw", "layer_kinds"]
