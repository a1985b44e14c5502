"""Loading a family's base weights the way users have them: a Hugging Face directory or a GGUF file.
The one owner of that: :func:`load_base` asks family/source.py once where the weights are and where
their caches go (:func:`family.source.locate`, data), then reads, converts and caches them here.

``transformers`` is the loader of first resort (it dequantizes GGUF and knows every config variant);
the weights are then handed to MFS's own nested model. Nothing here reaches a model hub: paths must
exist locally. The one module of family/ that imports torch: those who load weights (the worker,
training, evaluation, benches) import it; family/'s data modules, which the gateway reads, never do.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import structlog
import torch

from family.hfconfig import rope_params
from family.source import BaseSource, locate
from family.tokenizer import load_tokenizer

log = structlog.get_logger(__name__)


_UNLOADED = object()


@dataclass(slots=True)
class BaseWeights:
    hf_config: object
    state_dict: dict[str, torch.Tensor]
    source: str
    # where the tokenizer is read from when first asked for (None: none wanted); reading it imports
    # transformers, seconds that a worker serving no grammar request never needs to spend
    tokenizer_from: tuple[Path, str | None] | None = None
    _tokenizer: object = _UNLOADED

    @property
    def tokenizer(self):
        if self._tokenizer is _UNLOADED:
            self._tokenizer = load_tokenizer(*self.tokenizer_from) if self.tokenizer_from else None
        return self._tokenizer


def load_base(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              with_tokenizer: bool = True) -> BaseWeights:
    """Dequantizing a GGUF takes seconds; the result is cached once as a HF directory under
    $MFS_CACHE (default ~/.cache/mfs) and later loads read that instead. Those, and every load of a
    HF directory after its first, read the weights without transformers (:func:`_read_fast`). The
    tokenizer is read when first used (``.tokenizer``)."""
    src = locate(path)
    fast = _read_cached(src, dtype)
    if fast is None and src.gguf:
        # one process dequantizes a GGUF at a time (the workers of a cold `mfs up` start together): the
        # others wait, then read its cache
        with _converting(src):
            src = locate(path)
            fast = _read_cached(src, dtype)
            if fast is None:
                return _from_transformers(src, dtype, with_tokenizer)
    if fast is None:
        return _from_transformers(src, dtype, with_tokenizer)
    hf_config, sd = fast
    log.info("loading base weights", source=src.original, arch=hf_config.model_type, cached=src.cached)
    return BaseWeights(hf_config, sd, src.original, (src.folder, None) if with_tokenizer else None)


def _from_transformers(src: BaseSource, dtype: torch.dtype, with_tokenizer: bool) -> BaseWeights:
    hf_config, sd = _read_transformers(src, dtype)
    # the source located again: a GGUF whose cache _write_cache completed is now that cache, and its
    # tokenizer is read there, not converted from the GGUF's metadata a second time (3.4 s of CPU against
    # 0.2 s, 2 cores); a failed cache write leaves it to the GGUF
    now = locate(src.original) if with_tokenizer else None
    return BaseWeights(hf_config, sd, src.original, (now.folder, now.gguf) if now else None)


@contextmanager
def _converting(src: BaseSource):
    """An exclusive lock (flock) on ``<cache_dir>.lock`` while a GGUF is dequantized into its cache."""
    lock_path = src.cache_dir.with_name(src.cache_dir.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process dequantizing this GGUF", source=src.original)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_cached(src: BaseSource, dtype: torch.dtype) -> tuple[SimpleNamespace, dict[str, torch.Tensor]] | None:
    """The fast path where a complete config is at hand: the GGUF's cache (its config.json is
    transformers' complete to_dict()) or a HF directory's kept config; None otherwise."""
    if src.cached:
        return _read_fast(src.folder, json.loads((src.folder / "config.json").read_text()), dtype)
    if src.config_cache is not None and src.config_cache.exists():
        return _read_fast(src.folder, json.loads(src.config_cache.read_text())["config"], dtype)
    return None


def _read_transformers(src: BaseSource, dtype: torch.dtype) -> tuple[object, dict[str, torch.Tensor]]:
    """Through transformers (a GGUF dequantized, any config variant), writing the cache that makes the
    next load fast: the GGUF's dequantized copy, or the HF directory's complete config."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    kw = {"gguf_file": src.gguf} if src.gguf else {}
    hf_config = AutoConfig.from_pretrained(src.folder, **kw)
    log.info("loading base weights", source=src.original, arch=hf_config.model_type, cached=src.cached)
    # the config read above, passed on: transformers would otherwise parse the GGUF's metadata (its whole
    # vocabulary) twice more for it (~6 s of a cold start on 2 cores)
    model = AutoModelForCausalLM.from_pretrained(src.folder, config=hf_config,
                                                 dtype=torch.float32 if src.gguf else dtype, **kw)
    if src.gguf:
        _write_cache(model, src)
        model = model.to(dtype)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.eos_token_id is not None and hf_config.eos_token_id is None:
        hf_config.eos_token_id = gen.eos_token_id
    del model
    if src.config_cache is not None:
        _write_config_cache(src, hf_config)
    return hf_config, sd


def _read_fast(folder: Path, cfg: dict, dtype: torch.dtype) -> tuple[SimpleNamespace, dict[str, torch.Tensor]] | None:
    """Config and weights without transformers (whose import costs a worker ~3 s of its start on 2
    cores): ``cfg`` is a complete config (transformers' ``to_dict()``, every default filled in), the
    weights one safetensors file with transformers' names. None (the transformers path) for anything
    else, or a rope type whose frequencies only transformers computes."""
    weights = folder / "model.safetensors"
    if not weights.exists() or cfg.get("model_type") is None:
        return None
    ns = SimpleNamespace(**cfg)
    if any(rope_params(ns, t)["rope_type"] != "default" for t in {None, *(cfg.get("layer_types") or ())}):
        return None
    gen_path = folder / "generation_config.json"
    if cfg.get("eos_token_id") is None and gen_path.exists():
        cfg["eos_token_id"] = json.loads(gen_path.read_text()).get("eos_token_id")
    from safetensors.torch import load_file  # noqa: PLC0415
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(str(weights)).items()}
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # as transformers' state_dict has it
    return SimpleNamespace(**cfg), sd


def _write_config_cache(src: BaseSource, hf_config) -> None:
    """Best effort, and only where :func:`_read_fast` can use it (one safetensors file). Entries whose
    folder is gone (a test's, a deleted model's) are removed on the way."""
    folder = src.folder
    if not (folder / "model.safetensors").exists():
        return
    target = src.config_cache
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        cfg = hf_config.to_dict()
        cfg.pop("quantization_config", None)
        target.parent.mkdir(parents=True, exist_ok=True)
        for old in target.parent.glob("*.json"):
            try:
                if not Path(json.loads(old.read_text())["source"]).exists():
                    old.unlink()
            except (OSError, ValueError, KeyError, TypeError):
                old.unlink(missing_ok=True)
        tmp.write_text(json.dumps({"source": str(folder.resolve()), "config": cfg}, indent=1))
        tmp.replace(target)
    except (OSError, TypeError, ValueError) as e:
        log.warning("could not cache the complete config", error=str(e))
        tmp.unlink(missing_ok=True)


def _write_cache(model, src: BaseSource) -> None:
    """The GGUF's dequantized copy, with its tokenizer. Best effort: a failed cache write only costs the
    next load its speed."""
    folder, gguf, target = src.folder, src.gguf, src.cache_dir
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
