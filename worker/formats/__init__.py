"""Weight formats: each format's module declares its ``WeightFormat`` (weightformat.py says what one
declares) and its schemes, one per backend (scheme.py says what each declares); the registry lists them
by ``--weights`` name, one line each, with ``auto`` and every refusal in one place (registry.py); the
swap puts a format into a loaded model (swap.py). Formats: fp32.py, int8.py, int4.py, w4a8.py, w8a8.py,
kquant.py (``--weights gguf``: every tensor in its GGUF block type, those types' layouts in
kquant_blocks.py); groups.py is the Triton kernel's layout, gguf.py a GGUF's Q4_1 and Q8_0 blocks."""
from worker.formats.gguf import (GGUFSource, dequant_q4_1, dequant_q8_0, match_rows, q4_1_blocks,
                                 q8_0_blocks)
from worker.formats.groups import Group4Linear, GroupQuantLinear
from worker.formats.int4 import Int4Linear, q4_1_to_int4
from worker.formats.int8 import Int8A8Linear, Int8Embedding, Int8Linear
from worker.formats.kquant import GGUF, GGUFBlocksLinear, GGUFEmbedding
from worker.formats.registry import (AUTO, FORMATS, auto_choice, compile_refusal, may_quantize, names,
                                     parse_weights, register, resolve, resolve_mode, served, served_why,
                                     weights_why)
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig
from worker.formats.swap import (QuantReport, concat_linears, fuse_projections, linear_bytes_per_step, pack,
                                 quantize_model, rows_kernel_head, uncompilable, ungraphable)
from worker.formats.w4a8 import Q4A8Linear
from worker.formats.w8a8 import Int8DynamicLinear, reduce_range
from worker.formats.weightformat import Layout, WeightFormat

__all__ = ["AUTO", "FORMATS", "GGUF", "GGUF_BLOCK", "GGUFBlocksLinear", "GGUFEmbedding", "GGUFSource", "Group4Linear",
           "GroupQuantLinear", "Int4Linear", "Int8A8Linear", "Int8DynamicLinear", "Int8Embedding", "Int8Linear",
           "Layout", "Q4A8Linear", "QuantReport", "Scheme", "WeightConfig", "WeightFormat", "auto_choice",
           "compile_refusal", "concat_linears", "dequant_q4_1", "dequant_q8_0", "fuse_projections",
           "linear_bytes_per_step", "match_rows", "may_quantize", "names", "pack", "parse_weights", "q4_1_blocks",
           "q4_1_to_int4", "q8_0_blocks", "quantize_model", "reduce_range", "register", "resolve", "resolve_mode",
           "rows_kernel_head", "served", "served_why", "uncompilable", "ungraphable", "weights_why"]
