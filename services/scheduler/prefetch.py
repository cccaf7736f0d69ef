"""Prefetch hints from the head of the waiting queue.

While the current batch runs, the adapters the next requests will need can already travel disk -> host
arena -> GPU pool. The hints name, in service order, the first adapters of the queue head that no worker
holds yet, and give each to one worker: the one already hinted with it, else the least loaded. Routing
then prefers that worker for the adapter, so the prefetched copy is the one that gets used.
"""
from __future__ import annotations

from typing import Iterable

from services.scheduler.clustering import BASE
from services.scheduler.routing import WorkerView
from services.scheduler.waiting_queue import QueuedRequest


def prefetch_plan(head: Iterable[QueuedRequest], workers: Iterable[WorkerView], max_adapters: int) -> dict[str, list[str]]:
    """worker id -> adapters to prefetch there, in the order they will be needed (at most `max_adapters` in all)."""
    live = [w for w in workers if w.ready]
    plan: dict[str, list[str]] = {w.worker_id: [] for w in live}
    if not live or max_adapters <= 0:
        return plan
    seen: set[str] = set()
    extra_load = {w.worker_id: 0 for w in live}
    for request in head:
        adapter = request.adapter
        if adapter == BASE or adapter in seen:
            continue
        seen.add(adapter)
        if any(adapter in w.resident or adapter in w.running for w in live):
            continue
        already = [w for w in live if adapter in w.hinted]
        target = already[0] if already else min(live, key=lambda w: (w.load + extra_load[w.worker_id], w.worker_id))
        plan[target.worker_id].append(adapter)
        extra_load[target.worker_id] += 1
        if sum(len(v) for v in plan.values()) >= max_adapters:
            break
    return plan
