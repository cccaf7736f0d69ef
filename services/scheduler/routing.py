"""Routing queued requests to workers that have reported free capacity.

Workers pull work: each WorkerStatus says how many more requests it can take and how many pool slots
are free, and the scheduler hands out no more than that (minus what it already sent since the report).
A request goes to a worker where its adapter is resident, running or being prefetched (no adapter load),
else to the least loaded worker; clustering decides which requests join a batch first.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from services.scheduler.clustering import BASE, BatchAdapters
from services.scheduler.waiting_queue import QueuedRequest


@dataclass
class WorkerView:
    """The scheduler's picture of one worker, from its last status plus what was sent since."""

    worker_id: str
    free_requests: int = 0  # more requests it can take now
    free_slots: int = 0  # pool slots not holding KV or rows of adapters in use (unused ones are evicted for KV)
    resident: set[str] = field(default_factory=set)  # adapters in its GPU pool
    hinted: set[str] = field(default_factory=set)  # adapters it was asked to prefetch
    running: Counter = field(default_factory=Counter)  # adapter -> requests assigned and not finished
    ready: bool = True

    @property
    def load(self) -> int:
        return sum(self.running.values())

    def holds(self, adapter: str) -> bool:
        return adapter == BASE or adapter in self.resident or adapter in self.running or adapter in self.hinted


@dataclass
class _Budget:
    view: WorkerView
    batch: BatchAdapters
    requests: int
    slots: int
    load: int
    idle: bool

    def fits(self, request: QueuedRequest) -> bool:
        if self.requests <= 0:
            return False
        # An idle worker takes one request whatever its free slots say: it can evict adapters to make room,
        # and a request that can never fit must reach a worker to be answered with an error.
        return self.idle or self.slots >= request.prompt_tokens + 1

    def take(self, request: QueuedRequest) -> None:
        self.requests -= 1
        self.slots -= request.prompt_tokens + 1
        self.load += 1
        self.idle = False
        self.batch.add(request.adapter)


def plan(window: Iterable[QueuedRequest], workers: Iterable[WorkerView], d: int = 0, max_adapters: int = 0) -> list[tuple[QueuedRequest, str]]:
    """Assignments (request, worker id) for requests of `window`, taken in service order.

    Two passes, as adapter clustering asks: first every request some worker prefers (its adapter is in
    that batch, resident there, or the batch is still under `d` adapters), then the deferred ones
    wherever the hard bound `max_adapters` still allows.
    """
    budgets = [
        _Budget(w, BatchAdapters(w.running, w.resident | w.hinted, d, max_adapters), w.free_requests, w.free_slots, w.load, w.load == 0)
        for w in workers
        if w.ready and w.free_requests > 0
    ]
    out: list[tuple[QueuedRequest, str]] = []
    deferred: list[QueuedRequest] = []
    for request in window:
        if not any(b.requests > 0 for b in budgets):
            break
        budget = _choose(budgets, request, BatchAdapters.preferred)
        if budget is None:
            deferred.append(request)
            continue
        budget.take(request)
        out.append((request, budget.view.worker_id))
    for request in deferred:
        budget = _choose(budgets, request, BatchAdapters.allowed)
        if budget is not None:
            budget.take(request)
            out.append((request, budget.view.worker_id))
    return out


def _choose(budgets: list[_Budget], request: QueuedRequest, accepts) -> _Budget | None:
    candidates = [b for b in budgets if b.fits(request) and accepts(b.batch, request.adapter)]
    if not candidates:
        return None
    if request.adapter != BASE:
        affine = [b for b in candidates if b.view.holds(request.adapter) or request.adapter in b.batch.in_batch]
        candidates = affine or candidates
    return min(candidates, key=lambda b: (b.load, -b.slots, b.view.worker_id))
