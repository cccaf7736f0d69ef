"""Whether serving the queue oldest first still gives every queued request its first token in time.

S-LoRA turns to newest first whenever arrivals outpace admissions. In a short burst that the queue absorbs,
that starves its oldest requests until they are past the first-token SLO and early abort answers them,
although oldest first would have served every one in time. The `deadline` queue order keeps oldest first
while the queue, as it stands, drains in time, and turns to newest first only once it cannot: then oldest
first would make everything behind the late ones late too.

A queued request at position k (0 = served next) gets its first token about (k + 1) / admission rate
seconds from now, plus its prefill. Arrival order makes the wait so far fall and the position rise along
the queue, so the latest first token is the oldest request's or the youngest's: checking those two is enough.
"""
from __future__ import annotations

from services.scheduler.early_abort import PrefillEstimator
from services.scheduler.waiting_queue import WaitingQueue


def fcfs_keeps_deadlines(queue: WaitingQueue, now: float, slo_s: float, admissions_per_s: float,
                         estimator: PrefillEstimator) -> bool:
    """True when oldest first would still bring the oldest and the youngest fresh request's first token
    within `slo_s` of its arrival, at `admissions_per_s` (requests leaving the queue for workers)."""
    tenants = queue.tenants()  # only tenants with fresh requests: each lane has a head and a tail
    if not tenants:
        return True  # nothing fresh waits: no order can make anything late
    if admissions_per_s <= 0:
        return False  # nothing is leaving the queue: no drain can be counted on
    oldest = min((next(queue.lane(t)) for t in tenants), key=lambda r: r.arrival)
    youngest = max((next(queue.lane(t, newest_first=True)) for t in tenants), key=lambda r: r.arrival)
    # Retries go before every fresh request; the youngest waits for the whole queue.
    for request, ahead in ((oldest, queue.retry_count()), (youngest, len(queue) - 1)):
        waited = now - request.arrival
        if waited + (ahead + 1) / admissions_per_s + estimator.estimate(request.prompt_tokens) > slo_s:
            return False
    return True
