"""The `deadline` queue order's check: does oldest first still bring every queued request's first token in time?"""
from services.scheduler.early_abort import PrefillEstimator
from services.scheduler.queue_drain import fcfs_keeps_deadlines
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue

ONE_SECOND = PrefillEstimator(overhead_s=1.0, per_token_s=0.0)  # every prefill: 1 s


def queue_of(*items):
    q = WaitingQueue()
    for rid, arrival, tenant in items:
        q.push(QueuedRequest(rid, "", tenant, 10, 8, arrival))
    return q


def test_a_queue_that_drains_in_time_keeps_oldest_first():
    # At t = 10, 4 requests at 2 admissions/s: the youngest's first token in 0 + 4/2 + 1 = 3 s, the oldest's
    # in 2 + 0.5 + 1 = 3.5 s: both within 6 s.
    q = queue_of(("a", 8.0, ""), ("b", 9.0, ""), ("c", 9.5, ""), ("d", 10.0, ""))
    assert fcfs_keeps_deadlines(q, 10.0, 6.0, 2.0, ONE_SECOND)


def test_the_youngest_would_be_late_behind_a_long_queue():
    # 20 requests that all just arrived, 2 admissions/s: the last one's first token in 20/2 + 1 = 11 s.
    q = queue_of(*[(f"r{i}", 10.0, "") for i in range(20)])
    assert not fcfs_keeps_deadlines(q, 10.0, 6.0, 2.0, ONE_SECOND)
    assert fcfs_keeps_deadlines(q, 10.0, 12.0, 2.0, ONE_SECOND)


def test_the_oldest_would_be_late_already():
    # Two requests, but the older has waited 5 s: 5 + 1/2 + 1 > 6.
    q = queue_of(("old", 5.0, ""), ("new", 10.0, ""))
    assert not fcfs_keeps_deadlines(q, 10.0, 6.0, 2.0, ONE_SECOND)
    assert fcfs_keeps_deadlines(q, 10.0, 6.0, 2.0, PrefillEstimator(overhead_s=0.1, per_token_s=0.0))


def test_oldest_and_youngest_are_taken_across_tenants_and_retries_count_ahead():
    q = queue_of(("a1", 9.0, "a"), ("b1", 7.0, "b"), ("a2", 10.0, "a"))
    # b1 is the oldest (3 s waited): 3 + 1/1 + 1 = 5 fits; a2 the youngest: 0 + 3/1 + 1 = 4 fits.
    assert fcfs_keeps_deadlines(q, 10.0, 6.0, 1.0, ONE_SECOND)
    # Two requests given back by a dead worker go before b1: 3 + 3/1 + 1 = 7 > 6.
    for rid in ("lost1", "lost2"):
        q.push_retry(QueuedRequest(rid, "", "a", 10, 8, 0.0))
    assert not fcfs_keeps_deadlines(q, 10.0, 6.0, 1.0, ONE_SECOND)


def test_nothing_leaving_the_queue_means_no_drain_to_count_on():
    q = queue_of(("a", 10.0, ""))
    assert not fcfs_keeps_deadlines(q, 10.0, 6.0, 0.0, ONE_SECOND)
    assert fcfs_keeps_deadlines(WaitingQueue(), 10.0, 6.0, 0.0, ONE_SECOND)
