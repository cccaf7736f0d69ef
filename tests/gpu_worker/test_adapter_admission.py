"""A request whose adapter is still on its way from the store does not hold up the step: the engine admits
the requests behind it and asks again at the next step, and it runs (with the same tokens) once its adapter
is at hand. The loader never blocks for it."""
from __future__ import annotations

from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from tests.gpu_worker.test_lookahead import make_engine, model_dir, run, workload  # noqa: F401 (fixture)


class GatedLoader:
    """The engine's loader, with adapters in `closed` not ready yet (as if the store were reading them from
    disk); counts blocking loads per adapter."""

    def __init__(self, loader, closed: set[str]):
        self.loader = loader
        self.closed = set(closed)
        self.asked: dict[str, int] = {}
        self.loaded: dict[str, int] = {}

    def ready(self, name: str) -> bool:
        self.asked[name] = self.asked.get(name, 0) + 1
        return name not in self.closed

    def __call__(self, name: str):
        assert name not in self.closed, f"the engine waited on {name!r}, which is not ready"
        self.loaded[name] = self.loaded.get(name, 0) + 1
        return self.loader(name)


def collect(engine, results: dict) -> None:
    for out in engine.finish_step(engine.launch_step()):
        r = results.setdefault(out.request_id, {"tokens": [], "reason": None})
        r["tokens"] += out.new_token_ids
        if out.finished:
            r["reason"] = out.finish_reason


def test_requests_behind_an_adapter_still_loading_run_first(model_dir):  # noqa: F811
    reqs = workload(seed=4)
    slow = {r.request_id for r in reqs if r.adapter == "a1"}
    assert slow and len(slow) < len(reqs)
    expected = run(make_engine(model_dir, overlap=False), workload(seed=4))

    engine = make_engine(model_dir, overlap=False)
    gate = GatedLoader(engine.adapters.loader, closed={"a1"})
    engine.adapters.loader = gate
    for r in reqs:
        engine.add_request(r)
    results: dict = {}
    for _ in range(500):
        collect(engine, results)
        if all(results.get(r.request_id, {}).get("reason") for r in reqs if r.request_id not in slow):
            break
    others_done = {rid for rid, r in results.items() if r["reason"]}
    assert others_done == {r.request_id for r in reqs} - slow  # everyone else finished...
    assert not any(results.get(rid, {}).get("tokens") for rid in slow)  # ...while a1's requests waited
    assert gate.asked["a1"] > 1 and "a1" not in gate.loaded  # asked at every step, never waited on
    assert engine.capacity()["waiting"] == len(slow)

    gate.closed.clear()  # the store has answered
    for _ in range(500):
        if not engine.has_unfinished():
            break
        collect(engine, results)
    assert results == expected
    assert gate.loaded["a1"] == 1
    # No KV slot left behind.
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


def test_a_request_failing_to_load_after_waiting_fails_alone(model_dir):  # noqa: F811
    engine = make_engine(model_dir, overlap=False)
    gate = GatedLoader(engine.adapters.loader, closed={"gone"})
    engine.adapters.loader = gate
    engine.add_request(EngineRequest("lost", [5, 6, 7], SamplingParams(max_tokens=3), adapter="gone"))
    engine.add_request(EngineRequest("fine", [5, 6, 7], SamplingParams(max_tokens=3), adapter="a0"))
    results: dict = {}
    for _ in range(20):
        collect(engine, results)
    assert results["fine"]["reason"] == "length" and "lost" not in results
    gate.closed.clear()  # the store answers: no such adapter
    for _ in range(20):
        if not engine.has_unfinished():
            break
        collect(engine, results)
    assert results["lost"]["reason"] == "error" and results["lost"]["tokens"] == []
    assert not engine.has_unfinished()
