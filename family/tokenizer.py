"""A family's tokenizer, read with transformers' tokenizer classes (imported only when one is read;
the gateway reads it, so nothing here imports torch). Where a base is: family/source.py."""
from __future__ import annotations

import json
from pathlib import Path

import structlog

import family.source  # noqa: F401 - sets transformers' offline mode before it is imported

log = structlog.get_logger(__name__)


# tokenizer classes that are transformers' generic `tokenizers`-backed class (one class in
# transformers 5, two names): loaded through that class, AutoTokenizer's own choice for them
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: Path, gguf: str | None):
    """The family's tokenizer. A folder whose tokenizer_config.json names the generic tokenizers-backed
    class (the default family's cache, the tests' tiny families) is read through that class directly:
    AutoTokenizer would load the same class after importing model configurations (~3 s of a gateway's
    start on 2 cores against ~0.8 s)."""
    kw = {"gguf_file": gguf} if gguf else {}
    if gguf is None and not _has_tokenizer_files(folder):
        # AutoTokenizer would import every model configuration (~3 s on 2 cores) only to find none
        log.warning("no tokenizer found; token ids only", source=str(folder), error="no tokenizer files")
        return None
    try:
        if gguf is None and _tokenizer_class(folder) in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
            return PreTrainedTokenizerFast.from_pretrained(folder)
        from transformers import AutoTokenizer  # noqa: PLC0415
        return AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer found; token ids only", source=str(folder), error=str(e)[:200])
        return None


# the usual files a tokenizer is read from: tokenizer.json / tokenizer_config.json / tokenizer.model, BPE's
# vocab.json + merges.txt, WordPiece's vocab.txt, sentencepiece's spiece.model / *.spm, tiktoken files,
# Mistral's tekken.json, ProphetNet's prophetnet.tokenizer
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges*", "spiece*", "sentencepiece*", "*.model", "*.spm",
                    "*.tiktoken", "tekken*.json", "*.tokenizer")


def _has_tokenizer_files(folder: Path) -> bool:
    """Whether AutoTokenizer may find a tokenizer in ``folder``: one of the usual files, or a config.json
    naming a tokenizer class (byte-level tokenizers need no file)."""
    if any(next(folder.glob(pattern), None) is not None for pattern in _TOKENIZER_FILES):
        return True
    try:
        return bool(json.loads((folder / "config.json").read_text()).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


def _tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
