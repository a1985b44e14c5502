"""What every process does at start: logging (structlog to stderr, since stdout belongs to command
output; JSON lines for services) and how a service process stops."""
from __future__ import annotations

import logging
import os
import signal
import sys

import structlog


def configure(json_lines: bool | None = None, level: str | None = None) -> None:
    if not sys.stderr.isatty():
        # Not a terminal (a log file, `make up` piped, compose): no progress bars redrawn line by line
        # (transformers' "Loading weights" tqdm among them); TQDM_DISABLE=0 brings them back.
        os.environ.setdefault("TQDM_DISABLE", "1")
    json_lines = os.environ.get("MFS_LOG_JSON", "0") == "1" if json_lines is None else json_lines
    lvl = getattr(logging, (level or os.environ.get("MFS_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    processors = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                  structlog.processors.TimeStamper(fmt="iso", utc=True)]
    renderer = (structlog.processors.JSONRenderer() if json_lines
                else structlog.dev.ConsoleRenderer(colors=False))
    # JSON lines: log.exception's traceback as text in the line ("exception"), not a bare exc_info=true
    tracebacks = [structlog.processors.format_exc_info] if json_lines else []
    structlog.configure(processors=processors + tracebacks + [renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(lvl),
                        # sys.stderr looked up per logger, not bound once: whoever swaps it (pytest's
                        # capture between tests) must not leave the loggers writing to a closed file
                        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),
                        cache_logger_on_first_use=False)


def install_stop_signals() -> None:
    """SIGINT and SIGTERM both end a service process through KeyboardInterrupt, so its clean-up runs
    (a scheduler hands its lease over at once, a worker deregisters) even when it was started with
    SIGINT ignored (from a background job) or is stopped with SIGTERM (`docker compose stop`)."""
    def _interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
