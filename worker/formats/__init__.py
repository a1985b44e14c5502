"""Weight formats: one scheme per format and backend (worker/formats/scheme.py says what each
declares), the registry by ``--weights`` name with ``auto`` and every refusal in one place
(registry.py), and the swap that puts a format into a loaded model (swap.py). Modules: int8.py, int4.py,
w4a8.py, w8a8.py (CPU), groups.py (the Triton kernel's layout), gguf.py (a GGUF's own blocks), kquant.py
(``--weights gguf``: every tensor in its GGUF block type) with kquant_blocks.py (those types' layouts)."""
from worker.formats.gguf import (GGUFSource, dequant_q4_1, dequant_q8_0, match_rows, q4_1_blocks,
                                 q8_0_blocks)
from worker.formats.groups import Group4Linear, GroupQuantLinear
from worker.formats.int4 import Int4Linear, q4_1_to_int4
from worker.formats.int8 import Int8A8Linear, Int8Embedding, Int8Linear
from worker.formats.kquant import GGUF, GGUFBlocksLinear, GGUFEmbedding, served, served_why
from worker.formats.registry import (AUTO, FORMATS, Layout, WeightFormat, auto_choice, compile_refusal, names,
                                     parse_weights, register, resolve, resolve_mode, schemes,
                                     weights_why)
from worker.formats.scheme import GGUF_BLOCK, Scheme, Switches, WeightConfig
from worker.formats.swap import (QuantReport, concat_linears, fuse_projections, linear_bytes_per_step, pack,
                                 quantize_model, rows_kernel_head, uncompilable, ungraphable)
from worker.formats.w4a8 import Q4A8Linear
from worker.formats.w8a8 import Int8DynamicLinear, reduce_range

__all__ = ["AUTO", "FORMATS", "GGUF", "GGUF_BLOCK", "GGUFBlocksLinear", "GGUFEmbedding", "GGUFSource", "Group4Linear", "GroupQuantLinear", "Int4Linear",
           "Int8A8Linear", "Int8DynamicLinear", "Int8Embedding", "Int8Linear", "Layout", "Q4A8Linear",
           "QuantReport", "Scheme", "Switches", "WeightConfig", "WeightFormat", "auto_choice", "compile_refusal", "concat_linears",
           "dequant_q4_1", "dequant_q8_0", "fuse_projections", "linear_bytes_per_step", "match_rows", "names", "pack",
           "parse_weights", "q4_1_blocks", "q4_1_to_int4", "q8_0_blocks", "quantize_model", "reduce_range",
           "register", "resolve", "resolve_mode", "rows_kernel_head", "schemes", "served", "served_why", "uncompilable",
           "ungraphable", "weights_why"]
