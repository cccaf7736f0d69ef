from collections import Counter

from services.scheduler.routing import WorkerView, plan
from services.scheduler.waiting_queue import QueuedRequest


def req(rid, adapter, prompt=4, t=0.0):
    return QueuedRequest(rid, adapter, "t", prompt, 8, t)


def test_request_goes_where_its_adapter_is_resident_even_if_busier():
    w0 = WorkerView("w0", free_requests=4, free_slots=1000, running=Counter({"x": 3}))
    w1 = WorkerView("w1", free_requests=4, free_slots=1000, resident={"a"}, running=Counter({"y": 5}))
    out = plan([req("r1", "a"), req("r2", "b")], [w0, w1])
    assert [(r.request_id, w) for r, w in out] == [("r1", "w1"), ("r2", "w0")]


def test_without_affinity_the_least_loaded_worker_wins_and_load_spreads():
    ws = [WorkerView(f"w{i}", free_requests=10, free_slots=1000, running=Counter({"": load})) for i, load in enumerate([2, 0, 1])]
    out = plan([req(f"r{i}", "") for i in range(6)], ws)
    # Lowest load first; between equal loads the worker with more free slots.
    assert [w for _, w in out] == ["w1", "w2", "w1", "w0", "w2", "w1"]


def test_adapter_sent_to_one_worker_in_a_pass_sticks_to_it():
    ws = [WorkerView("w0", free_requests=5, free_slots=1000), WorkerView("w1", free_requests=5, free_slots=1000)]
    out = plan([req("r1", "a"), req("r2", "b"), req("r3", "a"), req("r4", "b")], ws)
    assert [w for _, w in out] == ["w0", "w1", "w0", "w1"]


def test_hinted_adapter_counts_as_affinity():
    ws = [WorkerView("w0", free_requests=5, free_slots=1000), WorkerView("w1", free_requests=5, free_slots=1000, hinted={"a"}, running=Counter({"": 2}))]
    assert [w for _, w in plan([req("r1", "a")], ws)] == ["w1"]


def test_capacity_limits_requests_and_slots():
    full = WorkerView("full", free_requests=0, free_slots=1000)
    small = WorkerView("small", free_requests=5, free_slots=30, running=Counter({"": 1}))
    out = plan([req("r1", "", prompt=20), req("r2", "", prompt=20), req("r3", "", prompt=5)], [full, small])
    # r1 takes 21 of 30 slots; r2 no longer fits; r3 (6 slots) does.
    assert [(r.request_id, w) for r, w in out] == [("r1", "small"), ("r3", "small")]


def test_idle_worker_takes_one_request_larger_than_its_free_slots():
    idle = WorkerView("w0", free_requests=5, free_slots=10)
    out = plan([req("big", "", prompt=100), req("next", "", prompt=100)], [idle])
    assert [r.request_id for r, _ in out] == ["big"]


def test_workers_not_ready_get_nothing():
    ws = [WorkerView("w0", free_requests=5, free_slots=1000, ready=False)]
    assert plan([req("r1", "")], ws) == []
