"""Structured logging: every event is a name plus fields (request id, adapter, worker), never a print."""
from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool = False, level: str = "info") -> None:
    lvl = getattr(logging, level.upper())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **fields):
    return structlog.get_logger(name).bind(logger=name, **fields)
