"""The torch-free leaf every process imports: request-level types (``SamplingParams``, why a request
ends) and the wire records with the Redis names they travel on (``core.protocol``). Nothing here
imports torch, aiohttp or another project package."""
