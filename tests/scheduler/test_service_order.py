from itertools import islice

from services.scheduler.ordering import service_order
from services.scheduler.rates import RateMonitor
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def ids(it, n=100):
    return [r.request_id for r in islice(it, n)]


def make_queue(spec):
    q = WaitingQueue()
    for rid, tenant, arrival in spec:
        q.push(QueuedRequest(rid, "", tenant, 4, 4, arrival))
    return q


def test_fcfs_when_keeping_up_and_lcfs_when_overloaded():
    q = make_queue([(f"r{i}", "t", float(i)) for i in range(5)])
    rates = RateMonitor(period_s=1.0, smoothing=1.0, now=0.0)
    rates.record_arrival(0.5, 3)
    rates.record_admission(0.6, 3)
    assert ids(service_order(q, rates.overloaded(1.5))) == ["r0", "r1", "r2", "r3", "r4"]
    rates.record_arrival(1.7, 9)
    rates.record_admission(1.8, 1)
    assert ids(service_order(q, rates.overloaded(2.5))) == ["r4", "r3", "r2", "r1", "r0"]


def test_requeued_requests_come_first_in_either_order():
    q = make_queue([("a", "t", 1.0), ("b", "t", 2.0)])
    q.push_retry(QueuedRequest("lost", "", "t", 4, 4, 0.5))
    assert ids(service_order(q, False)) == ["lost", "a", "b"]
    assert ids(service_order(q, True)) == ["lost", "b", "a"]


def test_tenants_take_turns_by_load():
    spec = [(f"big{i}", "big", float(i)) for i in range(6)] + [("small0", "small", 10.0), ("small1", "small", 11.0)]
    q = make_queue(spec)
    # No one in service: big's head is older, then turns alternate while small has requests.
    assert ids(service_order(q, False)) == ["big0", "small0", "big1", "small1", "big2", "big3", "big4", "big5"]
    # big already has 3 running: small goes first until the loads even out.
    assert ids(service_order(q, False, {"big": 3}), 4) == ["small0", "small1", "big0", "big1"]


def test_single_tenant_order_is_lazy():
    q = make_queue([(f"r{i}", "t", float(i)) for i in range(10_000)])
    assert ids(service_order(q, True), 2) == ["r9999", "r9998"]
