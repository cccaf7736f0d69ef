"""Structured logging for every loraplex process.

One call to `configure_logging` per process sets up structlog, and routes the standard library's
`logging` (uvicorn, httpx, ...) through the same renderer so a service's log is one consistent stream on
stderr: human-readable key=value lines by default, one JSON object per line with `json=True` (for log
collectors). Bind context such as request_id, adapter and worker on the logger rather than formatting it
into the message.
"""
from __future__ import annotations

import logging
import os
import sys

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


def _level(level: str | int) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str) and level.lower() in LEVELS:
        return LEVELS[level.lower()]
    raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LEVELS)}")


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that remembers the name it was asked for, so `add_logger_name` can report it."""

    def __init__(self, file, name: str | None = None) -> None:
        super().__init__(file)
        self.name = name or "loraplex"


class _Stderr:
    """Whatever sys.stderr is at write time (test runners and daemonisation swap it after logging is set up)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json: bool | None = None, level: str | int = "info", stream=None) -> None:
    """Set up structlog and stdlib logging for this process; safe to call again to change settings.
    `json=None` follows LORAPLEX_LOG_JSON=1, which the launcher sets for every child it starts, so one
    stack logs in one format."""
    if json is None:
        json = os.environ.get("LORAPLEX_LOG_JSON") == "1"
    numeric = _level(level)
    stream = _Stderr() if stream is None else stream
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.stdlib.add_logger_name, *shared, structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *args: _NamedPrintLogger(stream, *args[:1]),
        # Not cached: a logger created at import time must follow a later configure_logging call.
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_loraplex", False):
            root.removeHandler(old)
    handler._loraplex = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)


def get_logger(name: str, **context):
    """A structlog logger whose events carry `logger=name` plus any bound context.

    The result is a lazy proxy that resolves the configuration at each call, so a module-level logger
    follows a configure_logging that runs after its import (a later `.bind()` fixes it, as in structlog).
    """
    return structlog.get_logger(name, **context)
