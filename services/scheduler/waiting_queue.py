"""The global waiting queue: requests admitted by the scheduler but not yet assigned to a worker.

Two insertion-ordered maps keep every operation O(1): `fresh` holds new requests in arrival order, and
`retry` holds requests given back by a dead worker before they streamed anything. Retries are served
before any fresh request whatever the service order, because they were admitted long ago and a client
is already waiting on them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(eq=False)
class QueuedRequest:
    """What scheduling policy needs to know about one request; `submit` and `origin` are opaque to it."""

    request_id: str
    adapter: str  # "" = the base model (costs no adapter slot and does not count as a distinct adapter)
    tenant: str
    prompt_tokens: int
    max_tokens: int
    arrival: float  # monotonic seconds when the scheduler received it
    submit: Any = None  # the SubmitRequest, forwarded to the worker as it came
    origin: bytes = b""  # routing identity of the gateway that submitted it
    retries: int = field(default=0)


class WaitingQueue:
    def __init__(self) -> None:
        self._retry: dict[str, QueuedRequest] = {}
        # One arrival-ordered map per tenant, so fair ordering can take each tenant's head in O(1).
        self._fresh: dict[str, dict[str, QueuedRequest]] = {}
        self._where: dict[str, QueuedRequest] = {}
        self._per_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def get(self, request_id: str) -> QueuedRequest | None:
        return self._where.get(request_id)

    def tenant_count(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def tenants(self) -> list[str]:
        return list(self._fresh)

    def push(self, request: QueuedRequest) -> None:
        self._check_new(request)
        self._fresh.setdefault(request.tenant, {})[request.request_id] = request
        self._add(request)

    def push_retry(self, request: QueuedRequest) -> None:
        """Give back a request a worker lost; it goes ahead of every fresh request."""
        self._check_new(request)
        request.retries += 1
        self._retry[request.request_id] = request
        self._add(request)

    def remove(self, request_id: str) -> QueuedRequest | None:
        request = self._where.pop(request_id, None)
        if request is None:
            return None
        if self._retry.pop(request_id, None) is None:
            lane = self._fresh[request.tenant]
            del lane[request_id]
            if not lane:
                del self._fresh[request.tenant]
        self._per_tenant[request.tenant] -= 1
        if self._per_tenant[request.tenant] <= 0:
            del self._per_tenant[request.tenant]
        return request

    def all(self) -> list[QueuedRequest]:
        return list(self._where.values())

    def retry_count(self) -> int:
        return len(self._retry)

    def retries(self) -> Iterator[QueuedRequest]:
        return iter(self._retry.values())

    def lane(self, tenant: str, newest_first: bool = False) -> Iterator[QueuedRequest]:
        """One tenant's fresh requests, oldest first (FCFS) or newest first (LCFS).

        Iterators over live dicts: callers that remove while iterating must materialise a window first.
        """
        lane = self._fresh.get(tenant, {})
        return iter(reversed(lane.values()) if newest_first else lane.values())

    def _check_new(self, request: QueuedRequest) -> None:
        if request.request_id in self._where:
            raise ValueError(f"request {request.request_id!r} is already queued")

    def _add(self, request: QueuedRequest) -> None:
        self._where[request.request_id] = request
        self._per_tenant[request.tenant] += 1
