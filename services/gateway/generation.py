"""One generation request from submission to its last token, as a stream of text deltas.

The events of a request (TokenOutput, RequestRejected, or the client going away) arrive on one queue.
`deltas()` turns them into (text, finish_reason) pieces: detokenized incrementally, cut at stop strings,
with timings recorded for /metrics. Before the first token a refusal is an ApiError (the HTTP status has
not been sent yet); after it, a failure ends the stream with an error event.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from services.gateway.detokenize import IncrementalDetokenizer
from services.gateway.errors import ApiError
from services.gateway.stop_strings import StopStrings
from shared.wire import RequestRejected, TokenOutput

CLIENT_GONE = object()  # put on a request's queue when the HTTP client disconnects
# Refusals of a request that had been accepted into the queue count as aborts; the others as rejections.
ABORT_CODES = {"slo_unreachable", "worker_failed", "scheduler_unavailable", "shutting_down"}


class ClientGone(Exception):
    pass


class GenerationFailed(Exception):
    """The request died after output had begun (worker lost, engine error)."""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class Generation:
    request_id: str
    events: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    usage: Usage
    scheduler: object  # SchedulerClient: abort() when a stop string ends the request early
    metrics: object  # GatewayMetrics
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        while not self.finished:
            event = await self.events.get()
            if event is CLIENT_GONE:
                raise ClientGone()
            if isinstance(event, RequestRejected):
                self.finished = True
                if event.code in ABORT_CODES or self.first_token_at is not None:
                    self.metrics.aborts.labels(reason=event.code).inc()
                else:
                    self.metrics.rejections.labels(reason=event.code).inc()
                if self.first_token_at is None:
                    raise ApiError(event.status, event.message, None, event.code, retry_after=event.retry_after)
                raise GenerationFailed(event.message)
            piece = self._on_output(event)
            if piece is not None:
                yield piece

    def _on_output(self, out: TokenOutput) -> tuple[str, str | None] | None:
        now = time.monotonic()
        n = len(out.token_ids)
        if n:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.started_at)
            self.last_token_at = now
            self.usage.completion_tokens += n
        if out.finished and out.finish_reason in ("error", "abort"):
            self.finished = True
            self.metrics.aborts.labels(reason="worker_error").inc()
            message = out.error or "the request failed on the worker"
            if self.first_token_at is None:
                raise ApiError(500, message, None, "generation_failed")
            raise GenerationFailed(message)
        text = self.stops.feed(self.detokenizer.push(out.token_ids)) if n else ""
        if self.stops.stopped:
            if not out.finished:
                self.scheduler.abort(self.request_id, "stop_string")
            return self._finish(text, "stop")
        if out.finished:
            text += self.stops.feed(self.detokenizer.flush())
            if self.stops.stopped:
                return self._finish(text, "stop")
            text += self.stops.flush()
            return self._finish(text, "length" if out.finish_reason == "length" else "stop")
        return text, None

    def _finish(self, text: str, reason: str) -> tuple[str, str]:
        self.finished = True
        self.finish_reason = reason
        end = time.monotonic()
        self.metrics.e2e.observe(end - self.started_at)
        self.metrics.prompt_tokens.inc(self.usage.prompt_tokens)
        self.metrics.generation_tokens.inc(self.usage.completion_tokens)
        if self.first_token_at is not None and self.usage.completion_tokens > 1:
            self.metrics.per_token.observe((self.last_token_at - self.first_token_at) / (self.usage.completion_tokens - 1))
        return text, reason
