"""worker.kv_slot_run: a request's KV slots taken from the pool in runs, so its context lies in consecutive
slots; the tokens stay those of one slot at a time, a run's unwritten slots are freed with the request, and
where the pool is short a request takes only what it needs (preemption still works)."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.tiny_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("runs") / "model", preset="tiny-gqa", seed=3)


def serve(model_dir, requests, watch=None, **config) -> tuple[Engine, dict]:
    engine = Engine.from_model_dir(model_dir, EngineConfig(**config))
    for rid, prompt, max_tokens in requests:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    for _ in range(3000):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if watch is not None:
            watch(engine)
        if not engine.has_unfinished():
            return engine, tokens
    raise AssertionError("engine did not finish")


REQUESTS = [(f"r{i}", [3 + (7 * i + j) % 90 for j in range(5 + 9 * i)], 6 + 5 * i) for i in range(6)]


def test_runs_of_slots_serve_the_same_tokens_and_lay_each_context_out_in_consecutive_slots(model_dir):
    _, expected = serve(model_dir, REQUESTS)
    seen = []

    def runs_of(engine):
        for seq in engine.running:
            # Each whole run of 8 of the request's positions is 8 consecutive slot ids: the pool was fresh, so
            # its free list hands out ids in order.
            full = len(seq.slots) // 8 * 8
            for lo in range(0, full, 8):
                run = seq.slots[lo:lo + 8]
                assert run == list(range(run[0], run[0] + 8)), (seq.request_id, seq.slots)
            # What the request was given, used or spare, ends at a run's end (the pool had room).
            assert (len(seq.slots) + len(seq.spare_slots)) % 8 == 0, (seq.request_id, len(seq.slots))
            seen.append(len(seq.spare_slots))

    engine, got = serve(model_dir, REQUESTS, watch=runs_of, kv_slot_run=8)
    assert got == expected
    assert seen and max(seen) > 0  # spare slots were held between steps
    assert engine.pool.allocator.num_used == 0  # the unwritten ones were freed with their requests
    # One slot at a time, a decode step hands the batch's requests consecutive ids: contexts interleave.
    interleaved = []

    def one_at_a_time(engine):
        interleaved.extend(b - a for seq in engine.running for a, b in zip(seq.slots, seq.slots[1:]))

    serve(model_dir, REQUESTS, watch=one_at_a_time)
    assert any(step != 1 for step in interleaved)


def test_a_short_pool_takes_spare_slots_back_before_it_preempts(model_dir):
    _, expected = serve(model_dir, REQUESTS)
    one, _ = serve(model_dir, REQUESTS, num_slots=96, max_batched_tokens=32)
    engine, got = serve(model_dir, REQUESTS, num_slots=96, max_batched_tokens=32, kv_slot_run=16)
    assert got == expected
    # Six requests could hold up to 90 spare slots of 96: they go back to the pool before anyone is preempted,
    # so no more requests are preempted than one slot at a time does.
    assert engine.num_preemptions == one.num_preemptions > 0
    assert engine.pool.allocator.num_used == 0


@pytest.mark.parametrize("value", [0, 257, True, 2.0])
def test_kv_slot_run_must_be_a_count_of_slots(value):
    with pytest.raises(ValueError, match="kv_slot_run must be an integer from 1 to 256"):
        EngineConfig(kv_slot_run=value)
