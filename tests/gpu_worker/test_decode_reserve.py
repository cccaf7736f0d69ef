"""Admission keeps KV slots back for running requests' decode tokens (decode_reserve.py), in a real engine."""
from __future__ import annotations

import pytest

from services.gpu_worker.decode_reserve import DecodeReserve
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.tiny_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("reserve") / "model", preset="tiny-gqa", seed=1)


def serve_tight_pool(model_dir, reserve: DecodeReserve | None = None, **config) -> tuple[Engine, dict[str, list[int]]]:
    """Twelve requests whose outputs outgrow a 160-slot pool, on `reserve` if given; their tokens."""
    engine = Engine.from_model_dir(model_dir, EngineConfig(num_slots=160, max_batched_tokens=64, **config))
    if reserve is not None:
        engine.reserve = reserve
    for i in range(12):
        engine.add_request(EngineRequest(f"r{i}", [30 + i] * (8 + i),
                                         SamplingParams(max_tokens=20 + 2 * i, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 1000, "engine did not finish"
    return engine, tokens


def test_a_full_reserve_never_preempts_and_changes_no_token(model_dir):
    plain, expected = serve_tight_pool(model_dir)
    assert plain.num_preemptions > 0  # the workload does outgrow the pool without a reserve
    # Every preempted request had computed its prompt at least (8 tokens or more): that much is computed again.
    assert plain.recomputed_tokens >= 8 * plain.num_preemptions
    assert plain.capacity()["recomputed_tokens"] == plain.recomputed_tokens
    full, got = serve_tight_pool(model_dir, decode_reserve=1.0, decode_reserve_low=1.0)
    assert full.num_preemptions == 0 and full.recomputed_tokens == 0
    assert got == expected
    assert all(len(got[f"r{i}"]) == 20 + 2 * i for i in range(12))
    assert full.pool.allocator.num_used == 0


def test_a_partial_reserve_preempts_less(model_dir):
    plain, expected = serve_tight_pool(model_dir)
    half, got = serve_tight_pool(model_dir, decode_reserve=0.5, decode_reserve_low=0.5, decode_reserve_ease_s=1e9)
    assert 0 < half.num_preemptions < plain.num_preemptions
    assert got == expected
    assert half.capacity()["decode_reserve_share"] == 0.5
    assert plain.capacity()["decode_reserve_share"] == 0.0


def test_a_request_waits_while_the_running_ones_need_its_room_then_runs(model_dir):
    engine = Engine.from_model_dir(model_dir, EngineConfig(num_slots=160, max_batched_tokens=128,
                                                           decode_reserve=1.0, decode_reserve_low=1.0))
    engine.add_request(EngineRequest("big", list(range(3, 103)), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(EngineRequest("small", [5, 6], SamplingParams(max_tokens=10, ignore_eos=True)))
    engine.step()
    # 100 slots taken, big's 50 tokens to come and small's 2 + 10 make 162 of 160: small waits, unfailed.
    assert [seq.request_id for seq in engine.running] == ["big"]
    assert [seq.request_id for seq in engine.waiting] == ["small"]
    done = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.finish_reason
        if not engine.has_unfinished():
            break
    assert done == {"big": "length", "small": "length"}
    assert engine.num_preemptions == 0


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_share_eases_down_and_jumps_back_at_a_preemption():
    clock = FakeClock()
    reserve = DecodeReserve(0.6, 0.1, 10.0, clock=clock)
    assert reserve.share() == pytest.approx(0.6)
    clock.now += 5
    assert reserve.share() == pytest.approx(0.35)
    clock.now += 50
    assert reserve.share() == pytest.approx(0.1)
    reserve.preempted()
    assert reserve.share() == pytest.approx(0.6)
    assert reserve.slots([10, 7], 0.5) == 9  # rounded up: 8.5 tokens' slots
    assert reserve.slots([10, 7], 0.0) == 0
    assert DecodeReserve(0.0, 0.0, 10.0).share() == 0.0  # off: nothing kept back


def test_the_engine_raises_the_share_at_each_preemption(model_dir):
    # Eased all the way down (nothing kept back), the workload preempts as without a reserve; the engine's
    # first preemption takes the share back up to its high mark, read through the worker's capacity report.
    clock = FakeClock()
    reserve = DecodeReserve(0.5, 0.0, 10.0, clock=clock)
    clock.now += 60
    engine, _ = serve_tight_pool(model_dir, reserve)
    assert engine.num_preemptions > 0
    assert engine.capacity()["decode_reserve_share"] == 0.5


def test_remaining_output_stops_at_the_context_length():
    assert DecodeReserve.remaining_output(max_tokens=50, num_output=10, context=30, max_model_len=1000) == 40
    assert DecodeReserve.remaining_output(max_tokens=50, num_output=10, context=990, max_model_len=1000) == 10
    assert DecodeReserve.remaining_output(max_tokens=5, num_output=5, context=30, max_model_len=1000) == 0


@pytest.mark.parametrize("config, field", [
    ({"decode_reserve": 1.5}, "decode_reserve"),
    ({"decode_reserve": -0.1}, "decode_reserve"),
    ({"decode_reserve": True}, "decode_reserve"),
    ({"decode_reserve": 0.2, "decode_reserve_low": 0.5}, "decode_reserve_low"),
    ({"decode_reserve_ease_s": -1}, "decode_reserve_ease_s"),
    ({"decode_margin_steps": -1}, "decode_margin_steps"),
    ({"decode_margin_steps": 1.5}, "decode_margin_steps"),
    ({"decode_margin_steps": True}, "decode_margin_steps"),
])
def test_bad_reserve_settings_are_refused_by_name(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**config)
