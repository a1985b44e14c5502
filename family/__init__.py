"""The family as data (manifest, tiers, base weights' location, tokenizer, rope parameters): torch-free,
below the gateway and the worker; and its base weights read as tensors (``loader.py``, the one module
here that imports torch, never imported by the others)."""
