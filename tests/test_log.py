"""Logging: structured events with bound context, one stream for structlog and stdlib loggers."""
from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from shared.log import configure_logging, get_logger

# Created before any configuration, as module-level loggers in services are.
early = get_logger("early", worker=3)


@pytest.fixture
def stream():
    """A stream to log to; global logging state is put back afterwards for the tests that follow."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield io.StringIO()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def events(stream) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_events_carry_logger_level_and_context(stream):
    configure_logging(json=True, level="info", stream=stream)
    get_logger("engine", worker=0).bind(request_id="r1").info("request.finished", adapter="a7", tokens=5)
    (event,) = events(stream)
    assert event["event"] == "request.finished" and event["logger"] == "engine" and event["level"] == "info"
    assert (event["worker"], event["request_id"], event["adapter"], event["tokens"]) == (0, "r1", "a7", 5)
    assert event["timestamp"].endswith("Z")


def test_level_filters_and_a_logger_made_before_configuration_follows_it(stream):
    configure_logging(json=True, level="warning", stream=stream)
    early.info("dropped")
    early.warning("kept")
    configure_logging(json=True, level="debug", stream=stream)
    early.debug("now kept")
    assert [(e["event"], e["logger"], e["worker"]) for e in events(stream)] == [("kept", "early", 3), ("now kept", "early", 3)]


def test_stdlib_loggers_share_the_stream_and_renderer(stream):
    configure_logging(json=True, level="info", stream=stream)
    logging.getLogger("uvicorn.error").warning("port %d busy", 8000)
    logging.getLogger("uvicorn.error").debug("below level")
    (event,) = events(stream)
    assert (event["event"], event["logger"], event["level"]) == ("port 8000 busy", "uvicorn.error", "warning")


def test_console_format_is_one_readable_line(stream):
    configure_logging(json=False, level="info", stream=stream)
    get_logger("gateway").info("listening", port=8000)
    (line,) = stream.getvalue().splitlines()
    assert "listening" in line and "port=8000" in line and "[gateway]" in line and "info" in line


def test_exceptions_are_rendered_in_the_event(stream):
    configure_logging(json=True, stream=stream)
    try:
        raise RuntimeError("worker died")
    except RuntimeError:
        get_logger("launcher").exception("child.crashed")
    (event,) = events(stream)
    assert event["level"] == "error" and "RuntimeError: worker died" in event["exception"]


def test_unknown_level_is_named(stream):
    with pytest.raises(ValueError, match=r"unknown log level 'loud'; choose one of debug, info"):
        configure_logging(level="loud")
