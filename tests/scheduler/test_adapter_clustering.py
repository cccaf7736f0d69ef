from services.scheduler.clustering import BatchAdapters
from services.scheduler.routing import WorkerView, plan
from services.scheduler.waiting_queue import QueuedRequest


def reqs(adapters, prompt=4):
    return [QueuedRequest(f"r{i}-{a or 'base'}", a, "t", prompt, 8, float(i)) for i, a in enumerate(adapters)]


def one_worker(free=100, running=(), resident=()):
    from collections import Counter
    return WorkerView("w0", free_requests=free, free_slots=10_000, resident=set(resident), running=Counter(running))


def picked(assignments):
    return [r.request_id for r, _ in assignments]


def test_past_d_adapters_requests_of_batch_adapters_go_first():
    queue = reqs(["a", "b", "c", "a", "d", "b", "c"])
    out = plan(queue, [one_worker(free=5)], d=2)
    # a and b fill d=2; c and d wait while a/b requests remain; c (oldest deferred) fills the last place.
    assert picked(out) == ["r0-a", "r1-b", "r3-a", "r5-b", "r2-c"]


def test_resident_adapters_count_as_cheap_past_d():
    queue = reqs(["a", "x", "r", "y"])
    out = plan(queue, [one_worker(free=3, resident={"r"})], d=1)
    assert picked(out) == ["r0-a", "r2-r", "r1-x"]


def test_base_requests_never_count_as_adapters():
    queue = reqs(["a", "", "b", "", "a"])
    out = plan(queue, [one_worker(free=4)], d=1)
    assert picked(out) == ["r0-a", "r1-base", "r3-base", "r4-a"]


def test_hard_bound_on_distinct_adapters_per_batch():
    queue = reqs(["a", "b", "c", "d", "c"])
    out = plan(queue, [one_worker(free=10, running=["z"])], d=0, max_adapters=3)
    # z runs already; a and b reach the bound of 3; c, d and c never join this batch.
    assert picked(out) == ["r0-a", "r1-b"]


def test_d_zero_means_plain_service_order():
    queue = reqs(["a", "b", "c", "a"])
    assert picked(plan(queue, [one_worker(free=3)], d=0)) == ["r0-a", "r1-b", "r2-c"]


def test_batch_adapters_preferred_and_allowed():
    batch = BatchAdapters(running=["a", "b", ""], resident=["r"], d=2, max_adapters=3)
    assert batch.in_batch == {"a", "b"}
    assert batch.preferred("a") and batch.preferred("") and batch.preferred("r")
    assert not batch.preferred("new") and batch.allowed("new")
    batch.add("new")
    assert not batch.allowed("other") and not batch.preferred("r") and batch.allowed("a")
