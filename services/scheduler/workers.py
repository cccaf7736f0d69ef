"""What the scheduler tracks per worker and per request it has handed to a worker.

The scheduler counts a worker's outstanding requests itself (assigned minus finished), so the capacity
it grants does not depend on when the worker's last status was taken; only pool slots and the worker's
own backlog come from the status.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from services.scheduler.routing import WorkerView
from services.scheduler.waiting_queue import QueuedRequest
from shared.wire import WorkerStatus


@dataclass(eq=False)
class InFlight:
    """A request assigned to a worker and not finished yet."""

    request: QueuedRequest
    worker_id: str
    assigned_at: float
    streamed: bool = False  # some output reached the gateway: it can no longer be requeued silently
    aborted: bool = False  # the gateway gave up on it; outputs are dropped until the worker confirms


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    identity: bytes  # ROUTER routing id of the worker's socket
    last_seen: float
    status: WorkerStatus | None = None
    requests: dict[str, InFlight] = field(default_factory=dict)
    running: Counter = field(default_factory=Counter)  # adapter -> outstanding requests
    hinted: list[str] = field(default_factory=list)  # last prefetch hint sent, most urgent first
    sent_slots: int = 0  # slots of requests sent since the last status (not yet in its free_slots)

    @property
    def ready(self) -> bool:
        return self.status is not None and self.status.ready

    def on_status(self, status: WorkerStatus, now: float) -> None:
        self.status = status
        self.last_seen = now
        self.sent_slots = 0

    def add(self, flight: InFlight) -> None:
        self.requests[flight.request.request_id] = flight
        self.running[flight.request.adapter] += 1
        self.sent_slots += flight.request.prompt_tokens + 1

    def remove(self, request_id: str) -> InFlight | None:
        flight = self.requests.pop(request_id, None)
        if flight is not None:
            self.running[flight.request.adapter] -= 1
            if self.running[flight.request.adapter] <= 0:
                del self.running[flight.request.adapter]
        return flight

    def view(self, default_max_running: int) -> WorkerView:
        """The routing picture: free capacity as the worker reported it, less what was sent since."""
        status = self.status
        if status is None:
            return WorkerView(self.worker_id, ready=False)
        # Its batch plus the backlog it asked for: a worker admitting in rounds needs a round's worth waiting
        # on it when places free up, or each step would admit the few sent since the last status (and run
        # eagerly with their prefill) instead of one step admitting a whole round.
        cap = (status.max_running or default_max_running) + status.backlog
        free_requests = max(0, cap - len(self.requests))
        # A worker that admits each request as soon as it can, yet has some waiting, could not admit them:
        # sending more only parks requests where the scheduler can no longer reorder, route or early-abort
        # them. One that asked for a backlog is bounded by it instead: its waiting requests may only be
        # waiting for their round, or for an adapter on its way, while others could run.
        if status.waiting > 0 and not status.backlog:
            free_requests = 0
        return WorkerView(
            self.worker_id,
            free_requests=free_requests,
            free_slots=status.free_slots + status.evictable_slots - self.sent_slots,
            resident=set(status.resident_adapters),
            hinted=set(self.hinted),
            running=Counter(self.running),
            ready=status.ready,
        )
