"""`mfs bench peers --make-synthetic SHAPE`: the GGUF files the scale bench runs on, made once and kept.

A Llama-shaped model of a named size gets random weights (seeded, normal with std 0.02; norms 1), written
as a GGUF in f16 with gguf-py and SmolLM2's tokenizer, then quantized by llama.cpp's own quantizer
(``llama_model_quantize`` in llama-cpp-python, in a child process: its log goes to a file). Its answers
are meaningless; its speed is that of a model of its shape. ``smollm2-q4km`` is the default SmolLM2 GGUF
requantized to Q4_K_M (``allow_requantize``). Files go to ``$MFS_CACHE/peers`` (``~/.cache/mfs/peers``);
one already there is reused.

The tokenizer is SmolLM2's (49,152 tokens). A shape with a larger vocabulary (Llama 3's 128,256) keeps
the shape's embedding and head: the token list is padded with ``<|reserved_special_token_N|>`` entries
that no text ever encodes to, so the weights read per token are those of the real shape.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from family.source import cache_root

STD = 0.02
QUANT = "Q4_K_M"


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool                  # the head is the embedding (no output.weight), as Llama 3.2 1B and 3B
    rope_theta: float = 500000.0
    context: int = 8192
    rms_eps: float = 1e-5

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [rows, columns]) of every tensor, in file order."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                    (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)),
                    (b + "ffn_norm.weight", (h,)), (b + "ffn_gate.weight", (self.intermediate, h)),
                    (b + "ffn_up.weight", (self.intermediate, h)), (b + "ffn_down.weight", (h, self.intermediate))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h)))
        return out

    def params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


SHAPES = {
    # Llama 3.2 1B: 16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads, vocab 128,256, tied head
    "llama-1b": Shape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tied=True),
    # Llama 3.2 3B: 28 layers, hidden 3072, MLP 8192, 24 query / 8 KV heads, vocab 128,256, tied head
    "llama-3b": Shape(layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8, vocab=128256, tied=True),
}
REQUANTIZED = {"smollm2-q4km": "default-raw"}  # name -> the model whose GGUF is requantized
NAMES = (*SHAPES, *REQUANTIZED)


def peers_cache() -> Path:
    return cache_root() / "peers"


def _say_default(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)


def smollm2_gguf() -> Path:
    """The default family's GGUF, as the package ships it (its tokenizer is the synthetic files' too)."""
    from family.manifest import manifest_for, resolve_base  # noqa: PLC0415
    manifest, mdir = manifest_for(REQUANTIZED["smollm2-q4km"])
    return resolve_base(manifest.base, mdir)


@functools.cache
def _smollm2_tokenizer() -> tuple[tuple[str, object, object], ...]:
    """SmolLM2's tokenizer fields as (key, value, gguf type), read once a process."""
    import gguf  # noqa: PLC0415
    r = gguf.GGUFReader(str(smollm2_gguf()))
    return tuple((k, f.contents(), f.types[0] if f.types else None) for k, f in r.fields.items()
                 if k.startswith("tokenizer."))


def _tokenizer_fields(vocab: int) -> list[tuple[str, object, object]]:
    """SmolLM2's tokenizer fields, its token list padded to ``vocab``."""
    import gguf  # noqa: PLC0415
    out = []
    for key, value, vtype in _smollm2_tokenizer():
        if key == "tokenizer.ggml.tokens":
            if vocab < len(value):
                raise ValueError(f"vocab {vocab}: SmolLM2's tokenizer has {len(value)} tokens; a shape needs at least that")
            value = value + [f"<|reserved_special_token_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.CONTROL)] * (vocab - len(value))
        out.append((key, value, vtype))
    return out


def write_f16(shape: Shape, path: Path, seed: int = 0, say=_say_default) -> Path:
    """``shape`` with random weights (``seed``; normal, std 0.02; RMSNorm weights 1) as a llama GGUF in f16
    (norms in f32, as llama.cpp's converter writes them), one tensor in memory at a time."""
    import gguf  # noqa: PLC0415
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: hidden must divide by heads, and heads by kv_heads")
    w = gguf.GGUFWriter(None, "llama")
    w.add_name(f"mfs synthetic llama {shape.layers}x{shape.hidden} (random weights, seed {seed})")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype in _tokenizer_fields(shape.vocab):
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    tensors = shape.tensors()
    for name, s in tensors:
        dt = np.float32 if len(s) == 1 else np.float16
        w.add_tensor_info(name, s, np.dtype(dt), int(np.prod(s)) * np.dtype(dt).itemsize)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, s) in enumerate(tensors):
        if len(s) == 1:
            w.write_tensor_data(np.ones(s, np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(s, dtype=np.float32) * STD).astype(np.float16))
        if name.endswith("ffn_down.weight") or i == len(tensors) - 1:
            say(f"  f16 weights: {name} ({i + 1}/{len(tensors)} tensors)")
    w.close()
    os.replace(tmp, path)
    return path


QUANTIZE = """import ctypes, sys
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = int(sys.argv[3])
p.allow_requantize = True
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
sys.exit(rc)
"""


def quantize(src: Path, dst: Path, threads: int, say=_say_default) -> Path:
    """llama.cpp's quantizer, ``src`` -> ``dst`` in Q4_K_M (requantizing a quantized ``src``), in a child
    process whose log goes beside ``dst``."""
    import importlib.util  # noqa: PLC0415
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError("quantizing to Q4_K_M needs llama-cpp-python: `mfs bench peers --build-llama-cpp` builds it")
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
    log = dst.with_suffix(".quantize.log")
    say(f"  quantizing {src.name} -> {QUANT} with llama.cpp's quantizer ({threads} threads; log {log})")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", QUANTIZE, str(src), str(tmp), str(threads)], stdout=f, stderr=f)
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed (exit {r.returncode}): {log.read_text()[-1500:]}")
    os.replace(tmp, dst)
    return dst


def make(name: str, threads: int = 2, seed: int = 0, cache: Path | None = None, say=_say_default) -> Path:
    """The Q4_K_M GGUF called ``name`` (one of :data:`NAMES`): from the cache, or made there now."""
    if name not in NAMES:
        raise ValueError(f"--make-synthetic {name!r}: expected one of {', '.join(NAMES)}")
    cache = cache or peers_cache()
    if name in REQUANTIZED:
        dst = cache / f"{name}.{QUANT}.gguf"
        if not dst.exists():
            say(f"making {dst}")
            quantize(smollm2_gguf(), dst, threads, say)
        return dst
    stem = f"{name}-seed{seed}"
    dst = cache / f"{stem}.{QUANT}.gguf"
    if dst.exists():
        return dst
    f16 = cache / f"{stem}.f16.gguf"
    if not f16.exists():
        shape = SHAPES[name]
        say(f"making {f16}: {shape.params() / 1e9:.2f} B parameters, {asdict(shape)}")
        write_f16(shape, f16, seed, say)
    quantize(f16, dst, threads, say)
    return dst
