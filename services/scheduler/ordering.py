"""Service order of the waiting queue: FCFS normally, newest first while overloaded, fair across tenants.

Tenants take turns by load: the next request comes from the tenant with the fewest requests in service
(running on workers plus already picked in this pass), ties going to the tenant whose head request comes
first in FCFS/LCFS order. With one tenant this is plain FCFS or LCFS; with many, a tenant that floods
the queue cannot starve one that sends a request now and then.
"""
from __future__ import annotations

import heapq
from typing import Iterator, Mapping

from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def service_order(queue: WaitingQueue, newest_first: bool, in_service: Mapping[str, int] | None = None) -> Iterator[QueuedRequest]:
    """Requests in the order they should be offered to workers: requeued ones first, then fair turns.

    Lazy, so taking the first k costs O(k log tenants); materialise before changing the queue.
    """
    yield from queue.retries()
    in_service = in_service or {}
    heap = []
    lanes = {}
    for tenant in queue.tenants():
        lane = queue.lane(tenant, newest_first)
        head = next(lane, None)
        if head is not None:
            lanes[tenant] = lane
            heap.append(_key(in_service.get(tenant, 0), head, newest_first, tenant))
    heapq.heapify(heap)
    while heap:
        load, _, tenant, head = heapq.heappop(heap)
        yield head
        following = next(lanes[tenant], None)
        if following is not None:
            heapq.heappush(heap, _key(load + 1, following, newest_first, tenant))


def _key(load: int, head: QueuedRequest, newest_first: bool, tenant: str):
    return (load, -head.arrival if newest_first else head.arrival, tenant, head)
