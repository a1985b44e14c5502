"""The OpenAI-compatible HTTP front of MFS (aiohttp on uvloop); see gateway/README.md."""
