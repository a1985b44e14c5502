"""The family as data (manifest, tiers, base weights' location, tokenizer): torch-free, below
the gateway and the worker."""
