"""Loading a family's base weights the way users have them: a Hugging Face directory or a GGUF file.

``transformers`` is the loader (it dequantizes GGUF and knows every config variant); the weights are
then handed to MFS's own nested model. Nothing here reaches a model hub: paths must exist locally.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(slots=True)
class BaseWeights:
    hf_config: object
    state_dict: dict[str, torch.Tensor]
    tokenizer: object | None
    source: str


def split_source(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a HF directory, a .gguf file, or a dir holding one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist (MFS never downloads models)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p}: expected a Hugging Face directory or a .gguf file")
        return p.parent, p.name
    if (p / "config.json").exists():
        return p, None
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0]
    raise ValueError(f"{p}: no config.json and {'several' if ggufs else 'no'} .gguf files found")


def load_base(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              with_tokenizer: bool = True) -> BaseWeights:
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    folder, gguf = split_source(path)
    kw = {"gguf_file": gguf} if gguf else {}
    hf_config = AutoConfig.from_pretrained(folder, **kw)
    log.info("loading base weights", source=str(folder / (gguf or "")), arch=hf_config.model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.eos_token_id is not None and hf_config.eos_token_id is None:
        hf_config.eos_token_id = gen.eos_token_id
    del model
    tok = load_tokenizer(folder, gguf) if with_tokenizer else None
    return BaseWeights(hf_config, sd, tok, str(folder / (gguf or "")))


def load_tokenizer(folder: Path, gguf: str | None):
    from transformers import AutoTokenizer  # noqa: PLC0415
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        return AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer found; token ids only", source=str(folder), error=str(e)[:200])
        return None
