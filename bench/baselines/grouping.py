"""The PEFT baseline's queue: requests grouped by adapter, one adapter per batch, no continuous batching.

As in the S-LoRA paper's PEFT baseline: the server takes the adapter of the oldest waiting request and
runs up to `max_batch` waiting requests of that adapter (oldest first) as one padded batch to completion;
only then does it look at the queue again. Requests for other adapters wait, however long, which is
exactly the cost of serving many adapters without a unified, per-request LoRA computation.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class PendingRequest:
    """One accepted completion request on its way through the queue and the batch that runs it.

    `adapter` None means the base model. `stop_token_ids` is empty when EOS is ignored. The worker thread
    writes `emitted`/`finished`; the event loop sets `cancelled` when the client goes away.
    """

    request_id: str
    adapter: str | None
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    sink: object = None  # called on the event loop with (token_id, finish_reason) or an error string
    seq: int = -1  # arrival order, set by the queue
    arrival_s: float = field(default_factory=time.monotonic)
    emitted: int = 0
    finished: bool = False
    cancelled: bool = False

    @property
    def live(self) -> bool:
        return not (self.finished or self.cancelled)


class QueueClosed(Exception):
    pass


class GroupingQueue:
    """Waiting requests in arrival order; `take_batch` hands out one adapter's group at a time."""

    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self._waiting: list[PendingRequest] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False

    def put(self, request: PendingRequest) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed("the server is shutting down")
            request.seq = next(self._seq)
            self._waiting.append(request)
            self._cond.notify()

    def depth(self) -> int:
        with self._cond:
            return sum(1 for r in self._waiting if not r.cancelled)

    def close(self) -> list[PendingRequest]:
        """Refuse new requests, wake the worker; returns the requests that will never run."""
        with self._cond:
            self._closed = True
            left, self._waiting = self._waiting, []
            self._cond.notify_all()
        return left

    def take_batch(self, timeout_s: float | None = None) -> list[PendingRequest] | None:
        """The next group (one adapter, oldest first, at most max_batch), or None on close or timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                # A request whose client left before its batch began is dropped here, unrun.
                self._waiting = [r for r in self._waiting if not r.cancelled]
                if self._waiting:
                    break
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            adapter = self._waiting[0].adapter
            batch: list[PendingRequest] = []
            rest: list[PendingRequest] = []
            for r in self._waiting:
                (batch if r.adapter == adapter and len(batch) < self.max_batch else rest).append(r)
            self._waiting = rest
            return batch


@dataclass
class BatchRecord:
    """What one batch was: for /stats, so grouping can be checked from outside the process."""

    adapter: str | None
    request_ids: list[str]
    prompt_lens: list[int]
    max_tokens: list[int]
    steps: int = 0
    load_s: float = 0.0  # time spent making the adapter resident before the batch
    run_s: float = 0.0
    error: str | None = None

    def as_dict(self) -> dict:
        return {"adapter": self.adapter, "size": len(self.request_ids), "request_ids": self.request_ids,
                "prompt_lens": self.prompt_lens, "max_tokens": self.max_tokens, "steps": self.steps,
                "load_s": round(self.load_s, 6), "run_s": round(self.run_s, 6), "error": self.error}


class BatchLog:
    """The most recent batches and running totals, written by the worker thread, read by HTTP handlers."""

    def __init__(self, keep: int = 10_000):
        self._lock = threading.Lock()
        self._recent: deque[BatchRecord] = deque(maxlen=keep)
        self.batches = 0
        self.requests = 0
        self.generated_tokens = 0

    def add(self, record: BatchRecord, generated_tokens: int) -> None:
        with self._lock:
            self._recent.append(record)
            self.batches += 1
            self.requests += len(record.request_ids)
            self.generated_tokens += generated_tokens

    def snapshot(self) -> dict:
        with self._lock:
            return {"batches_total": self.batches, "requests_total": self.requests,
                    "generated_tokens_total": self.generated_tokens,
                    "batches": [r.as_dict() for r in self._recent]}
