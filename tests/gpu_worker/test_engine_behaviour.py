"""Engine lifecycle: stops, aborts, failures and limits, without the reference stack."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.tiny_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("behaviour") / "model", preset="tiny-gqa", seed=1)


def engine_for(model_dir, **config) -> Engine:
    return Engine.from_model_dir(model_dir, EngineConfig(**config))


def drain(engine: Engine, limit: int = 500) -> dict:
    results: dict[str, dict] = {}
    for _ in range(limit):
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "reason": None, "error": None})
            r["tokens"] += out.new_token_ids
            if out.finished:
                r["reason"], r["error"] = out.finish_reason, out.error
        if not engine.has_unfinished():
            return results
    raise AssertionError("engine did not finish")


def test_max_tokens_ends_with_length(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    r = drain(engine)["a"]
    assert len(r["tokens"]) == 4 and r["reason"] == "length"
    assert engine.pool.allocator.num_used == 0


def test_stop_token_ends_with_stop_and_is_the_last_token(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("probe", [9, 10, 11], SamplingParams(max_tokens=5, ignore_eos=True)))
    probe = drain(engine)["probe"]["tokens"]
    engine.add_request(EngineRequest("b", [9, 10, 11], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(probe[2],))))
    r = drain(engine)["b"]
    assert r["reason"] == "stop" and r["tokens"] == probe[: probe.index(probe[2]) + 1]


def test_eos_stops_unless_ignored(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("probe", [20, 21], SamplingParams(max_tokens=3, ignore_eos=True)))
    first = drain(engine)["probe"]["tokens"][0]
    engine.cfg = engine.cfg.__class__(**{**engine.cfg.__dict__, "eos_token_ids": (first,)})
    engine.add_request(EngineRequest("eos", [20, 21], SamplingParams(max_tokens=3)))
    engine.add_request(EngineRequest("ignored", [20, 21], SamplingParams(max_tokens=3, ignore_eos=True)))
    results = drain(engine)
    assert results["eos"]["tokens"] == [first] and results["eos"]["reason"] == "stop"
    assert len(results["ignored"]["tokens"]) == 3 and results["ignored"]["reason"] == "length"


def test_abort_frees_slots_and_reports_once(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("long", list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(EngineRequest("queued", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    assert engine.pool.allocator.num_used > 0
    assert engine.abort("long") and not engine.abort("missing")
    results = drain(engine)
    assert results["long"]["reason"] == "abort"
    assert results["queued"]["reason"] == "length"
    assert engine.pool.allocator.num_used == 0


def test_unknown_adapter_fails_only_that_request(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("bad", [4, 5], SamplingParams(max_tokens=2), adapter="nope"))
    engine.add_request(EngineRequest("good", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
    results = drain(engine)
    assert results["bad"]["reason"] == "error" and "nope" in results["bad"]["error"]
    assert results["good"]["reason"] == "length"


@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "at least one token"),
    ([1] * 600, SamplingParams(max_tokens=10), "exceeds the context length"),
    ([1, 10**6], SamplingParams(), "outside the vocabulary"),
    ([1], SamplingParams(top_p=0.0), "top_p"),
])
def test_bad_requests_are_refused_with_the_reason(model_dir, prompt, params, message):
    engine = engine_for(model_dir, max_model_len=512)
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest("x", prompt, params))
    assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_survives_preemption(model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    roomy = engine_for(model_dir, num_slots=2048)
    for i in range(6):
        roomy.add_request(EngineRequest(f"r{i}", [30 + i] * (10 + i), params))
    expected = drain(roomy)
    tight = engine_for(model_dir, num_slots=60, max_batched_tokens=32)
    for i in range(6):
        tight.add_request(EngineRequest(f"r{i}", [30 + i] * (10 + i), params))
    got = drain(tight, limit=2000)
    assert tight.num_preemptions > 0
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in expected.items()}


def test_adapter_staged_for_an_aborted_waiting_request_is_let_go(model_dir, tmp_path):
    from shared.make_adapters import make_adapters
    from shared.adapter_format import load_adapter
    from shared.model_config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    [adapter_dir] = make_adapters(tmp_path / "ad", model_dir, 1, ranks=[8], seed=3)
    engine = engine_for(model_dir, num_slots=200, max_lora_rank=8)
    packed = engine.register_adapter("big", load_adapter(adapter_dir, cfg, 8))
    # A base request fills most of the pool, so the adapter request must wait with its adapter staged.
    engine.add_request(EngineRequest("hog", list(range(3, 200 - packed.n_slots + 10)), SamplingParams(max_tokens=5, ignore_eos=True)))
    engine.add_request(EngineRequest("waits", [4, 5], SamplingParams(max_tokens=2), adapter="big"))
    engine.step()
    assert "big" in engine.adapters.held_names and "big" not in engine.adapters.names
    engine.abort("waits")
    engine.step()
    assert "big" not in engine.adapters.held_names


def test_requests_added_and_aborted_while_a_step_is_in_flight(model_dir):
    engine = engine_for(model_dir)
    engine.add_request(EngineRequest("runs", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.add_request(EngineRequest("ends", [8, 9], SamplingParams(max_tokens=1, ignore_eos=True)))
    flight = engine.launch_step()
    # Host work while the step runs: a new request arrives, a running one and a finishing one are aborted.
    engine.add_request(EngineRequest("late", [10, 11], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert engine.abort("runs") and engine.abort("ends")
    assert engine.pool.allocator.num_used > 0, "slots of the step in flight must not be freed yet"
    outputs = engine.finish_step(flight) + drain_outputs(engine)
    terminal = {}
    for out in outputs:
        if out.finished:
            assert out.request_id not in terminal, f"{out.request_id} ended twice"
            terminal[out.request_id] = out.finish_reason
    assert terminal == {"runs": "abort", "ends": "length", "late": "length"}
    assert engine.pool.allocator.num_used == 0


def drain_outputs(engine: Engine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_busy_batch_admits_waiting_requests_in_rounds(model_dir, overlap):
    # 16 running places, so a round is min(admission_batch, 16 // 8 = 2, queue length) requests.
    engine = engine_for(model_dir, max_running_requests=16, admission_batch=4, overlap_steps=overlap)
    for i in range(16):  # request i finishes after i + 2 tokens, one per step from the third step on
        engine.add_request(EngineRequest(f"run{i}", [3, 4, 5], SamplingParams(max_tokens=i + 2, ignore_eos=True)))
    for i in range(6):
        engine.add_request(EngineRequest(f"wait{i}", [6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
    running, finished = [], 0
    for _ in range(12):
        finished += sum(1 for out in engine.step() if out.finished)
        running.append(len(engine.running))
    # From the second step on one request finishes per step (counted after it left); admission waits until
    # two places are free, then fills both, so the batch alternates 14 and 15 instead of staying at 15.
    # Launched ahead, a round takes the places of requests ending (by length) in the step before it, so
    # the batch is back at 16 the step a round runs.
    assert running[:6] == ([16, 15, 16, 15, 16, 15] if overlap else [16, 15, 14, 15, 14, 15]), running
    results = drain(engine)
    assert {f"wait{i}" for i in range(6)} <= set(results) and engine.pool.allocator.num_used == 0


def _steps_until_admitted(engine: Engine, request_id: str, age_s: float = 0.0) -> int:
    """32 running requests finishing one a step from the third step on, then one more arriving: the step at
    which it joins the batch (its wait made `age_s` older than it is)."""
    for i in range(32):
        engine.add_request(EngineRequest(f"run{i}", [3, 4, 5], SamplingParams(max_tokens=i + 2, ignore_eos=True)))
    engine.step()
    engine.add_request(EngineRequest(request_id, [6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
    engine.waiting[-1].queued_at -= age_s
    for step in range(1, 20):
        engine.step()
        if any(seq.request_id == request_id for seq in engine.running):
            drain(engine)
            return step
    raise AssertionError(f"{request_id} was never admitted")


def test_admission_wait_holds_a_busy_batch_for_a_whole_round(model_dir):
    # A round is min(admission_batch 4, 32 // 8) = 4 places; one request waits.
    eager = _steps_until_admitted(engine_for(model_dir, max_running_requests=32, admission_batch=4), "late")
    patient = engine_for(model_dir, max_running_requests=32, admission_batch=4, admission_wait_s=60.0)
    held = _steps_until_admitted(patient, "late")
    # Without a wait it joins at the first free place; with one, once four places are free: three steps later.
    assert held == eager + 3, (eager, held)
    assert patient.pool.allocator.num_used == 0
    # A request that has already waited admission_wait_s joins at the first free place again.
    overdue = engine_for(model_dir, max_running_requests=32, admission_batch=4, admission_wait_s=60.0)
    assert _steps_until_admitted(overdue, "late", age_s=61.0) == eager


@pytest.mark.parametrize("value", [-1.0, True, "soon"])
def test_admission_wait_must_be_seconds(value):
    with pytest.raises(ValueError, match="admission_wait_s must be a number of seconds >= 0"):
        EngineConfig(admission_wait_s=value)


@pytest.mark.parametrize("overlap", [False, True])
def test_admission_batch_of_one_refills_every_step(model_dir, overlap):
    engine = engine_for(model_dir, max_running_requests=16, admission_batch=1, overlap_steps=overlap)
    for i in range(16):
        engine.add_request(EngineRequest(f"run{i}", [3, 4, 5], SamplingParams(max_tokens=i + 2, ignore_eos=True)))
    for i in range(6):
        engine.add_request(EngineRequest(f"wait{i}", [6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
    running = []
    for _ in range(8):
        engine.step()
        running.append(len(engine.running))
    # Every finished place refilled at the next step; launched ahead, in the step its request ends, until
    # the six waiting requests are in.
    assert running == ([16] * 7 + [15] if overlap else [16] + [15] * 7), running


@pytest.mark.parametrize("value", [0, -3, True, 2.5])
def test_admission_batch_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="admission_batch must be an integer >= 1"):
        EngineConfig(admission_batch=value)


def test_resident_rows_are_at_least_the_running_batch(model_dir):
    # A batch of requests each with its own adapter runs whole: a resident row for each.
    assert EngineConfig(max_running_requests=8192).max_resident_adapters == 8192
    assert EngineConfig(max_running_requests=12, max_resident_adapters=5).max_resident_adapters == 5
    with pytest.raises(ValueError, match="max_resident_adapters must be >= 0"):
        EngineConfig(max_resident_adapters=-1)
    engine = engine_for(model_dir, max_running_requests=6, max_resident_adapters=6)
    assert engine.adapters.tables.ranks.shape[0] == 6
    assert engine_for(model_dir, max_running_requests=6).adapters.tables.ranks.shape[0] == 4096
