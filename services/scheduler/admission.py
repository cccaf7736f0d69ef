"""Admission control at the door of the waiting queue: a bounded queue and a bound per tenant.

A full queue is answered at once with 429 and a Retry-After the client can act on, instead of letting
the request wait for a slot it would get too late; a tenant over its own bound is refused alone, so one
tenant's flood does not push everyone else out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.waiting_queue import WaitingQueue

QUEUE_FULL = "queue_full"
TENANT_QUEUE_FULL = "tenant_queue_full"


@dataclass(frozen=True)
class Rejection:
    reason: str
    message: str
    retry_after_s: int


class Admission:
    def __init__(self, max_queue: int, max_queue_per_tenant: int = 0, min_retry_s: int = 1, max_retry_s: int = 60):
        if max_queue <= 0:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        if max_queue_per_tenant < 0:
            raise ValueError(f"max_queue_per_tenant must be >= 0 (0 = no per-tenant bound), got {max_queue_per_tenant}")
        self.max_queue = max_queue
        self.max_queue_per_tenant = max_queue_per_tenant
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s

    def check(self, queue: WaitingQueue, tenant: str, service_rate: float) -> Rejection | None:
        """None when the request may join the queue, else why not and when to try again.

        `service_rate` is requests leaving the queue per second; the wait it implies for the backlog in
        front of the request is the Retry-After.
        """
        if len(queue) >= self.max_queue:
            return Rejection(QUEUE_FULL, f"the waiting queue is full ({self.max_queue} requests)",
                             self.retry_after(len(queue), service_rate))
        if self.max_queue_per_tenant and queue.tenant_count(tenant) >= self.max_queue_per_tenant:
            return Rejection(TENANT_QUEUE_FULL,
                             f"this tenant already has {self.max_queue_per_tenant} requests waiting",
                             self.retry_after(queue.tenant_count(tenant), service_rate))
        return None

    def retry_after(self, backlog: int, service_rate: float) -> int:
        if service_rate <= 0:
            return self.max_retry_s if backlog else self.min_retry_s
        return max(self.min_retry_s, min(self.max_retry_s, math.ceil(backlog / service_rate)))
