"""The in-process engine (a scheduler and a model runner in one process), below the CLI: tests,
benches, training and evaluation drive the nested model through it."""
from engine.engine import Engine, InvalidRequest, RequestOutput

__all__ = ["Engine", "InvalidRequest", "RequestOutput"]
