"""Adapters stay resident in the unified pool after their requests end, far beyond the running batch, and
give up their slots when KV needs them (least recently used first): serving thousands of adapters, a worker
copies each into its pool once while there is room, and reports those slots as KV's on demand."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.adapter_format import load_adapter
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

ADAPTERS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("resident")
    model = make_model(root / "model", preset="tiny-gqa", seed=5)
    make_adapters(root / "adapters", model, ADAPTERS, ranks=(4, 8), targets=("q_proj", "v_proj", "o_proj"), seed=7)
    return model


def engine_with_adapters(model_dir, **config) -> Engine:
    engine = Engine.from_model_dir(model_dir, EngineConfig(max_running_requests=2, **config))
    cfg = ModelConfig.from_dir(model_dir)
    for i, folder in enumerate(sorted((model_dir.parent / "adapters").iterdir())):
        engine.register_adapter(f"a{i}", load_adapter(folder, cfg, name=f"a{i}"))
    return engine


def serve(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    """Runs requests to the end, at most two at a time (the running batch); their tokens."""
    tokens: dict[str, list[int]] = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return tokens


def one_per_adapter(tag: str, order: list[int], prompt_len: int = 5) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}{i}", [3 + (i + k) % 90 for k in range(prompt_len)],
                          SamplingParams(max_tokens=3, ignore_eos=True), adapter=f"a{i}") for i in order]


def check_counts(engine: Engine) -> None:
    """The kept totals equal a recount, and every used slot is an adapter row or reserved."""
    residents = [engine.adapters._by_name[n] for n in engine.adapters.names]
    assert engine.adapters.slots_in_use == sum(len(r.slots) for r in residents)
    assert engine.adapters.unused_slots == sum(len(r.slots) for r in residents if r.refcount == 0)
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


def test_the_default_keeps_thousands_of_resident_rows():
    assert EngineConfig().max_resident_adapters == 4096
    assert EngineConfig(max_running_requests=5000).max_resident_adapters == 5000
    assert EngineConfig(max_resident_adapters=5).max_resident_adapters == 5


def test_adapters_stay_resident_beyond_the_running_batch_and_are_copied_in_once(model_dir):
    engine = engine_with_adapters(model_dir)
    first = serve(engine, one_per_adapter("r", list(range(ADAPTERS))))
    assert sorted(engine.adapters.names) == sorted(f"a{i}" for i in range(ADAPTERS))  # 12 kept, batch of 2
    assert engine.adapters.loads == ADAPTERS
    check_counts(engine)
    cap = engine.capacity()
    assert cap["evictable_slots"] == engine.adapters.slots_in_use > 0  # all unused: KV's on demand
    assert cap["free_slots"] + cap["evictable_slots"] + engine.reserved_slots == cap["total_slots"]

    again = serve(engine, one_per_adapter("r", list(reversed(range(ADAPTERS)))))
    assert engine.adapters.loads == ADAPTERS  # every adapter was still there
    assert again == first  # and computes the same tokens from its pool rows
    check_counts(engine)


def test_kv_takes_the_slots_of_the_least_recently_used_adapters(model_dir):
    probe = engine_with_adapters(model_dir)
    serve(probe, one_per_adapter("p", list(range(ADAPTERS))))
    adapter_slots = probe.adapters.slots_in_use
    order = [5, 2, 9, 0, 11, 7, 1, 4, 10, 3, 8, 6]  # last use, oldest first

    # A pool that all twelve adapters fill but for 40 slots, and a prompt needing 120 KV slots.
    engine = engine_with_adapters(model_dir, num_slots=adapter_slots + 40 + probe.reserved_slots)
    serve(engine, one_per_adapter("r", order))
    assert len(engine.adapters.names) == ADAPTERS and engine.pool.allocator.num_free == 40
    long = EngineRequest("long", [7 + k % 50 for k in range(117)], SamplingParams(max_tokens=3, ignore_eos=True))
    expected = serve(Engine.from_model_dir(model_dir, EngineConfig()), [long])
    assert serve(engine, [EngineRequest("long", list(long.prompt_ids), long.sampling)]) == expected

    kept = [f"a{i}" for i in order if f"a{i}" in engine.adapters.names]
    assert kept == [f"a{i}" for i in order[len(order) - len(kept):]]  # the oldest went first
    assert 0 < len(kept) < ADAPTERS
    check_counts(engine)
