"""Loading a family's base weights the way users have them: a Hugging Face directory or a GGUF file.

``transformers`` is the loader (it dequantizes GGUF and knows every config variant); the weights are
then handed to MFS's own nested model. Nothing here reaches a model hub: paths must exist locally.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from family.source import gguf_cache_dir, load_tokenizer, resolve_cached, split_source

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class BaseWeights:
    hf_config: object
    state_dict: dict[str, torch.Tensor]
    tokenizer: object | None
    source: str


def load_base(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              with_tokenizer: bool = True) -> BaseWeights:
    """Dequantizing a GGUF takes seconds; the result is cached once as a HF directory under
    $MFS_CACHE (default ~/.cache/mfs) and later loads read that instead."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    src_folder, src_gguf = split_source(path)
    original = str(src_folder / (src_gguf or ""))
    folder, gguf = resolve_cached(path)
    kw = {"gguf_file": gguf} if gguf else {}
    hf_config = AutoConfig.from_pretrained(folder, **kw)
    log.info("loading base weights", source=original, arch=hf_config.model_type,
             cached=original != str(folder / (gguf or "")))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32 if gguf else dtype, **kw)
    if gguf:
        _write_cache(model, folder, gguf)
        model = model.to(dtype)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.eos_token_id is not None and hf_config.eos_token_id is None:
        hf_config.eos_token_id = gen.eos_token_id
    del model
    tok = load_tokenizer(folder, gguf) if with_tokenizer else None
    return BaseWeights(hf_config, sd, tok, original)


def _write_cache(model, folder: Path, gguf: str) -> None:
    """Best effort: a failed cache write only costs the next load its speed."""
    target = gguf_cache_dir(folder, gguf)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        from safetensors.torch import save_file  # noqa: PLC0415
        tmp.mkdir(parents=True, exist_ok=True)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok = load_tokenizer(folder, gguf)
        if tok is not None:
            tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(folder / gguf))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as e:  # noqa: BLE001 - any failure only costs speed
        log.warning("could not cache dequantized weights", error=str(e))
        shutil.rmtree(tmp, ignore_errors=True)
