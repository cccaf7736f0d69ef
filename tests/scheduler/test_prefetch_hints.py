from collections import Counter

from services.scheduler.ordering import service_order
from services.scheduler.prefetch import prefetch_plan
from services.scheduler.routing import WorkerView
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def queue(adapters):
    q = WaitingQueue()
    for i, a in enumerate(adapters):
        q.push(QueuedRequest(f"r{i}", a, "t", 4, 4, float(i)))
    return q


def test_hints_follow_service_order_and_skip_held_adapters():
    q = queue(["a", "", "b", "a", "c", "d", "e"])
    w = WorkerView("w0", resident={"b"}, running=Counter({"c": 1}))
    assert prefetch_plan(service_order(q, False), [w], max_adapters=2) == {"w0": ["a", "d"]}
    # Newest first while overloaded: the hints follow the order requests will actually be served.
    assert prefetch_plan(service_order(q, True), [w], max_adapters=2) == {"w0": ["e", "d"]}


def test_hints_spread_over_workers_and_keep_earlier_choices():
    q = queue(["a", "b", "c", "d"])
    w0 = WorkerView("w0", running=Counter({"": 1}))
    w1 = WorkerView("w1", hinted={"c"})
    plan = prefetch_plan(service_order(q, False), [w0, w1], max_adapters=10)
    assert plan == {"w0": ["b", "d"], "w1": ["a", "c"]}


def test_no_ready_worker_no_hints():
    q = queue(["a"])
    assert prefetch_plan(service_order(q, False), [WorkerView("w0", ready=False)], 4) == {}
    assert prefetch_plan(service_order(q, False), [WorkerView("w0")], 0) == {"w0": []}
