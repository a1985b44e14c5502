"""MFS: serve a whole LLM model family from one nested model."""
__version__ = "0.1.0"
