import pytest

from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def req(rid, t, tenant="t", adapter="a", prompt=10):
    return QueuedRequest(rid, adapter, tenant, prompt, 16, float(t))


def test_lanes_keep_arrival_order_and_lcfs_reverses_it():
    q = WaitingQueue()
    for i in range(4):
        q.push(req(f"r{i}", i))
    assert [r.request_id for r in q.lane("t")] == ["r0", "r1", "r2", "r3"]
    assert [r.request_id for r in q.lane("t", newest_first=True)] == ["r3", "r2", "r1", "r0"]


def test_remove_updates_tenant_counts_and_drops_empty_lanes():
    q = WaitingQueue()
    q.push(req("a1", 0, tenant="a"))
    q.push(req("b1", 1, tenant="b"))
    q.push(req("b2", 2, tenant="b"))
    assert (q.tenant_count("a"), q.tenant_count("b"), len(q)) == (1, 2, 3)
    assert q.remove("a1").request_id == "a1"
    assert q.remove("a1") is None
    assert q.tenant_count("a") == 0 and q.tenants() == ["b"]
    assert "b2" in q and "a1" not in q


def test_retry_counts_as_queued_and_is_listed_apart():
    q = WaitingQueue()
    q.push(req("fresh", 0))
    lost = req("lost", 5)
    q.push_retry(lost)
    assert lost.retries == 1
    assert [r.request_id for r in q.retries()] == ["lost"]
    assert q.tenant_count("t") == 2
    q.remove("lost")
    assert list(q.retries()) == [] and len(q) == 1


def test_duplicate_request_id_is_refused():
    q = WaitingQueue()
    q.push(req("x", 0))
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("x", 1))
    with pytest.raises(ValueError, match="already queued"):
        q.push_retry(req("x", 1))
