"""Steps launched ahead of the last step's tokens (lookahead.py) change nothing a client sees: the same
tokens, finish reasons and stop positions as an engine that waits for every step, no slot left behind,
aborts honoured while two steps are in flight."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.adapter_format import load_adapter
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.tiny_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookahead")
    model = make_model(root / "model", preset="tiny-gqa", seed=3)
    make_adapters(root / "adapters", model, 2, ranks=(4, 8), targets=("q_proj", "v_proj", "o_proj"), seed=10)
    return model


def make_engine(model_dir, overlap: bool, **config) -> Engine:
    engine = Engine.from_model_dir(model_dir, EngineConfig(overlap_steps=overlap, **config))
    cfg = ModelConfig.from_dir(model_dir)
    for i, folder in enumerate(sorted((model_dir.parent / "adapters").iterdir())):
        engine.register_adapter(f"a{i}", load_adapter(folder, cfg, name=f"a{i}"))
    return engine


def workload(seed: int = 0) -> list[EngineRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(14):
        sampling = SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.5)
        if i % 5 == 1:
            sampling.temperature, sampling.seed = 0.8, i  # sampled on the host: no lookahead past it
        reqs.append(EngineRequest(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))],
                                  sampling, adapter=(None, "a0", "a1")[i % 3]))
    return reqs


def run(engine: Engine, reqs: list[EngineRequest], stop_after: dict[str, int] | None = None,
        abort_at: dict[int, str] | None = None) -> dict:
    results: dict[str, dict] = {}
    pending = list(reqs)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:  # requests arrive while others run
            engine.add_request(pending.pop(0))
        flight = engine.launch_step()
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])  # arrives while the step runs, as from the worker's socket
        for out in engine.finish_step(flight):
            r = results.setdefault(out.request_id, {"tokens": [], "reason": None})
            r["tokens"] += out.new_token_ids
            if out.finished:
                r["reason"] = out.finish_reason
        step += 1
        assert step < 2000
    return results


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("admission", [True, False])
def test_same_tokens_with_and_without_lookahead(model_dir, device, admission):
    # On CUDA the steps ahead replay decode graphs, their input tokens copied on the device; admission
    # rounds launched ahead run eagerly, their decode rows' tokens copied the same way.
    reqs = workload()
    plain = run(make_engine(model_dir, overlap=False, device=device), reqs)
    engine = make_engine(model_dir, overlap=True, admission_batch=1, device=device, cuda_graph_max_batch=16,
                         overlap_admission=admission)
    ahead = run(engine, workload())
    assert engine.lookahead_steps > 10, engine.lookahead_steps
    assert (engine.admissions_ahead > 0) == admission, engine.admissions_ahead
    # Requests sampled at a temperature (every fifth) keep their steps on the host, and say so.
    assert engine.held_back["batch"] > 0 and not engine.held_back["slots"], engine.held_back
    assert ahead == plain
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots
    assert not engine.running and not engine._by_id and engine.page_table


def test_stop_token_found_after_the_next_step_was_launched(model_dir):
    # Learn what a request generates, then stop it at a token it first makes after "long" joined: the step
    # after it is already in flight when that token reaches the host, and its extra token must not be
    # delivered.
    probe = run(make_engine(model_dir, overlap=False), [EngineRequest("p", [7, 8, 9], SamplingParams(max_tokens=16, ignore_eos=True))])
    tokens = probe["p"]["tokens"]
    stop = next(t for k, t in enumerate(tokens) if k >= 6 and t not in tokens[:k])
    engine = make_engine(model_dir, overlap=True)
    reqs = [EngineRequest("s", [7, 8, 9], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(stop,))),
            EngineRequest("long", [4, 5], SamplingParams(max_tokens=20, ignore_eos=True))]
    out = run(engine, reqs)
    assert out["s"]["tokens"] == tokens[: tokens.index(stop) + 1] and out["s"]["reason"] == "stop"
    assert len(out["long"]["tokens"]) == 20 and out["long"]["reason"] == "length"
    assert engine.lookahead_steps > 0
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


def test_abort_while_a_step_is_launched_ahead(model_dir):
    engine = make_engine(model_dir, overlap=True)
    reqs = [EngineRequest(f"x{i}", [3 + i, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True), adapter="a0")
            for i in range(3)]
    out = run(engine, reqs, abort_at={8: "x1", 9: "x0"})
    assert out["x1"]["reason"] == "abort" and out["x0"]["reason"] == "abort"
    assert len(out["x1"]["tokens"]) < 30 and len(out["x0"]["tokens"]) < 30
    assert out["x2"]["reason"] == "length" and len(out["x2"]["tokens"]) == 30
    assert engine.lookahead_steps > 0
    assert not engine.has_unfinished()
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


def test_admission_rounds_launched_ahead_with_a_full_batch(model_dir):
    """A batch of three, requests ending by length and by stop tokens while the next round is already on its
    way: the same tokens as an engine that waits for every step, every page-table row and slot given back."""
    probe = run(make_engine(model_dir, overlap=False), [EngineRequest("p", [9, 8, 7], SamplingParams(max_tokens=12, ignore_eos=True))])
    tokens = probe["p"]["tokens"]
    stop = next(t for k, t in enumerate(tokens) if k >= 3 and t not in tokens[:k])

    def reqs():
        out = []
        for i in range(10):
            if i % 4 == 0:  # the probe's request: it stops at `stop`, found on the host a step late
                out.append(EngineRequest(f"q{i}", [9, 8, 7], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                          stop_token_ids=(stop,))))
                continue
            out.append(EngineRequest(f"q{i}", [5 + i, 6, 7 + i][: 1 + i % 3],
                                     SamplingParams(max_tokens=3 + (5 * i) % 9, ignore_eos=True),
                                     adapter=(None, "a0", "a1")[i % 3]))
        return out

    config = dict(max_running_requests=3, admission_batch=1)
    plain = run(make_engine(model_dir, overlap=False, **config), reqs())
    engine = make_engine(model_dir, overlap=True, **config)
    ahead = run(engine, reqs())
    assert ahead == plain
    assert engine.admissions_ahead > 0 and engine.lookahead_steps > engine.admissions_ahead
    assert any(r["reason"] == "stop" for r in ahead.values())
    assert not engine.has_unfinished()
    assert engine.page_table.free_rows == 3 + 1 - engine.reserved_slots
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True])
def test_a_round_takes_the_places_of_requests_ending_by_length_in_the_step_in_flight(model_dir, device, chunked):
    """A full batch, a long queue, rounds of three: each round becomes due only through requests whose last
    token (by length) the step in flight samples. Their places go to the round launched ahead of that step's
    tokens, and clients see exactly what an engine that waits for every step gives them. Chunked: a step's
    token budget ends inside a prompt, whose next chunk goes ahead too."""
    def reqs():
        rng = random.Random(5)
        return [EngineRequest(f"f{i}", [rng.randrange(3, 200) for _ in range((4 + 3 * (i % 5)) if chunked else 1 + i % 5)],
                              SamplingParams(max_tokens=2 + (7 * i) % 11, ignore_eos=True),
                              adapter=(None, "a0", "a1")[i % 3]) for i in range(30)]

    def run_queued(engine: Engine) -> dict:
        for r in reqs():
            engine.add_request(r)  # all queued at once: the batch stays full until the queue is empty
        return run(engine, [])

    config = dict(max_running_requests=6, admission_batch=3, device=device)
    if chunked:
        config["max_batched_tokens"] = 24
    plain = run_queued(make_engine(model_dir, overlap=False, **config))
    engine = make_engine(model_dir, overlap=True, **config)
    ahead = run_queued(engine)
    assert ahead == plain
    assert all(r["reason"] == "length" for r in ahead.values()) and len(ahead) == 30
    assert engine.places_taken_ahead >= 10, engine.places_taken_ahead
    stats = engine.step_stats
    if chunked:  # steps that carried only the rest of a prompt: a round's prompts did not fit one step
        assert stats.steps["prefill"] > engine.admission_steps
    # Only the first admission step (nothing ran before it) was scheduled on the host after a step's tokens;
    # the worker's step counters say the same.
    assert engine.admission_steps >= 10 and engine.admission_steps - engine.admissions_ahead <= 1, (
        engine.admission_steps, engine.admissions_ahead)
    # Decode steps are "graph" steps where CUDA graphs replay them, "decode" otherwise.
    assert stats.ahead["decode"] + stats.ahead["graph"] > 0 and all(stats.ahead[k] <= stats.steps[k] for k in stats.steps)
    assert stats.ahead["prefill"] >= stats.steps["prefill"] - 1, (stats.ahead, stats.steps)
    assert not engine.has_unfinished() and not engine._by_id
    assert engine.page_table.free_rows == 6 + 1 - engine.reserved_slots
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_go_ahead_when_kv_must_evict_cached_adapters(model_dir, device):
    """With many adapters the pool fills with unused ones kept for later requests, and decode steps take
    their KV slots by evicting them (n = 2000 on the H200: pool free slots at 0 for most of the point). A step
    launched ahead evicts as the host's scheduler would, rather than falling back to waiting for the tokens
    of the step before."""
    warm = [EngineRequest(f"w{i}", [5, 6, 7], SamplingParams(max_tokens=1), adapter=f"a{i}") for i in range(2)]
    rng = random.Random(7)
    reqs = [EngineRequest(f"b{i}", [rng.randrange(3, 200) for _ in range(30)],
                          SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(4)]
    results = []
    for overlap in (False, True):
        engine = make_engine(model_dir, overlap=overlap, num_slots=256, device=device)
        run(engine, warm)
        cached = engine.adapters.slots_in_use
        # Resident, used by nobody (CUDA graphs hold reserved_slots of their own).
        assert cached > 0 and engine.pool.allocator.num_used == cached + engine.reserved_slots
        stats_before = {k: (engine.step_stats.steps[k], engine.step_stats.ahead[k]) for k in ("decode", "graph")}
        results.append(run(engine, reqs))
        # The base requests' KV (4 x 60 slots) exceeds what the cached adapters leave free: some were evicted.
        assert engine.adapters.slots_in_use < cached
        assert engine.pool.allocator.num_used == engine.adapters.slots_in_use + engine.reserved_slots
    decode = sum(engine.step_stats.steps[k] - stats_before[k][0] for k in stats_before)
    ahead = sum(engine.step_stats.ahead[k] - stats_before[k][1] for k in stats_before)
    assert results[0] == results[1]
    assert all(r["reason"] == "length" and len(r["tokens"]) == 30 for r in results[1].values())
    # Every decode step went ahead, as where nothing is cached (the evicting ones included).
    assert decode >= 29 and ahead == decode, (ahead, decode)
    assert not engine.held_back["slots"], engine.held_back


def test_a_step_held_back_for_slots_says_so(model_dir):
    """Where even evicting every unused adapter leaves too few slots, the step waits for the host's
    scheduler, which preempts; the engine counts why it was not launched ahead."""
    rng = random.Random(8)
    reqs = [EngineRequest(f"p{i}", [rng.randrange(3, 200) for _ in range(40)],
                          SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(3)]
    plain = run(make_engine(model_dir, overlap=False, num_slots=256), reqs)
    engine = make_engine(model_dir, overlap=True, num_slots=256)
    assert run(engine, reqs) == plain
    assert engine.num_preemptions > 0 and engine.held_back["slots"] > 0, (engine.num_preemptions, engine.held_back)
    assert not engine.has_unfinished() and engine.pool.allocator.num_used == engine.reserved_slots


@pytest.mark.parametrize("ending_slots", [True, False])
@pytest.mark.parametrize("cached", [False, True])
def test_a_step_short_of_slots_goes_ahead_on_those_of_a_request_ending_by_length(model_dir, cached, ending_slots):
    """The pool is exactly full when the step in flight samples one request's last token (by length): the
    next step's decode slot comes from that request's slots, given early, as the host would free them once
    the tokens are in, rather than the step waiting for those tokens. Nobody waits, so no round takes them.
    Cached: an adapter nobody uses holds slots too, and stays cached, as the host frees the ending request's
    slots before it would evict one. With overlap_ending_slots off (to measure it), the step instead evicts
    the cached adapter or waits for the step before; the same tokens either way."""
    def serve(overlap: bool) -> tuple[Engine, dict]:
        engine = make_engine(model_dir, overlap=overlap, num_slots=256, overlap_ending_slots=ending_slots)
        if cached:
            run(engine, [EngineRequest("w", [5, 6, 7], SamplingParams(max_tokens=1), adapter="a1")])
            assert engine.adapters.slots_in_use > 0
        free = engine.pool.allocator.num_free
        last = 10  # A's max_tokens: step last - 1 samples its last token
        # After step k a request holds prompt + k slots; at step last - 1 both together hold every free slot.
        prompt_a = 40
        prompt_b = free - prompt_a - 2 * (last - 1)
        rng = random.Random(11)
        engine.add_request(EngineRequest("A", [rng.randrange(3, 200) for _ in range(prompt_a)],
                                         SamplingParams(max_tokens=last, ignore_eos=True)))
        engine.add_request(EngineRequest("B", [rng.randrange(3, 200) for _ in range(prompt_b)],
                                         SamplingParams(max_tokens=last + 6, ignore_eos=True)))
        return engine, run(engine, [])

    plain_engine, plain = serve(overlap=False)
    engine, ahead = serve(overlap=True)
    assert ahead == plain and len(ahead["A"]["tokens"]) == 10 and len(ahead["B"]["tokens"]) == 16
    assert plain_engine.num_preemptions == 0 and engine.num_preemptions == 0
    if not ending_slots:
        if cached:  # the cached adapter's slots went to the step instead
            assert engine.adapters.slots_in_use < plain_engine.adapters.slots_in_use
        else:
            assert engine.held_back["slots"] == 1, engine.held_back
        assert engine.places_taken_ahead == 0
        return
    assert engine.adapters.slots_in_use == plain_engine.adapters.slots_in_use
    assert engine.places_taken_ahead == 1 and not engine.held_back["slots"], (engine.places_taken_ahead,
                                                                              engine.held_back)
    stats = engine.step_stats
    assert stats.ahead["decode"] == stats.steps["decode"] == 15, (stats.ahead, stats.steps)
    assert not engine.has_unfinished()
    assert engine.pool.allocator.num_used == engine.reserved_slots + engine.adapters.slots_in_use


def test_a_decode_margin_lets_steps_go_ahead_where_the_pool_binds(model_dir):
    """A long queue on a pool the running requests outgrow: admitting whatever fits leaves the next step
    short of its decode slots again and again, and it waits for the step before. Keeping one step's decode
    slots free (decode_margin_steps) lets those steps go ahead; clients see the same tokens."""
    rng = random.Random(12)
    reqs = [EngineRequest(f"m{i}", [rng.randrange(3, 200) for _ in range(rng.randrange(8, 40))],
                          SamplingParams(max_tokens=rng.randrange(8, 40), ignore_eos=True)) for i in range(24)]

    def serve(overlap: bool, margin: int) -> tuple[Engine, dict]:
        engine = make_engine(model_dir, overlap=overlap, num_slots=256, max_running_requests=12,
                             decode_margin_steps=margin)
        for r in reqs:
            engine.add_request(copy.deepcopy(r))
        return engine, run(engine, [])

    _, plain = serve(overlap=False, margin=0)
    bare, got_bare = serve(overlap=True, margin=0)
    kept, got_kept = serve(overlap=True, margin=1)
    assert got_bare == plain and got_kept == plain
    assert all(r["reason"] == "length" for r in plain.values()) and len(plain) == 24
    assert bare.held_back["slots"] > 0, bare.held_back  # the pool does bind this workload
    assert kept.held_back["slots"] < bare.held_back["slots"], (kept.held_back, bare.held_back)
    assert kept.lookahead_steps > bare.lookahead_steps, (kept.lookahead_steps, bare.lookahead_steps)
    for engine in (bare, kept):
        assert not engine.has_unfinished() and engine.pool.allocator.num_used == engine.reserved_slots


@pytest.mark.parametrize("device", DEVICES)
def test_steps_held_back_without_overlap_admission_say_why(model_dir, device):
    """With overlap_admission off, a step carrying the rest of a prompt, or admitting a round, is scheduled
    on the host; the engine counts each under its reason, and decode steps still go ahead."""
    def reqs():
        rng = random.Random(9)
        return [EngineRequest(f"h{i}", [rng.randrange(3, 200) for _ in range(6 + 5 * (i % 3))],
                              SamplingParams(max_tokens=3 + (5 * i) % 7, ignore_eos=True),
                              adapter=(None, "a0", "a1")[i % 3]) for i in range(12)]

    config = dict(max_running_requests=4, admission_batch=2, max_batched_tokens=12, device=device)
    plain = run(make_engine(model_dir, overlap=False, **config), reqs())
    engine = make_engine(model_dir, overlap=True, overlap_admission=False, **config)
    assert run(engine, reqs()) == plain
    assert engine.admissions_ahead == 0 and engine.lookahead_steps > 0
    assert engine.held_back["prompt"] > 0 and engine.held_back["round"] > 0, engine.held_back
    assert not engine.held_back["slots"], engine.held_back


def test_a_round_due_through_an_abort_in_the_step_waits_for_its_tokens(model_dir):
    """A full batch of two, a queue, rounds of one: a request aborted while its step runs frees its place
    only once that step ends (its slots are still written), so a round due through it alone is not launched
    ahead; the engine says why."""
    engine = make_engine(model_dir, overlap=True, max_running_requests=2, admission_batch=1)
    for i in range(2):
        engine.add_request(EngineRequest(f"long{i}", [3 + i, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    engine.add_request(EngineRequest("queued", [6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    flight = engine.launch_step()
    engine.abort("long0")  # arrives while the step runs, as from the worker's socket
    before = engine.held_back["round"]
    outs = engine.finish_step(flight)
    assert engine.held_back["round"] == before + 1, engine.held_back
    results = {}
    for out in outs + [o for _ in range(60) if engine.has_unfinished() for o in engine.step()]:
        results.setdefault(out.request_id, []).append(out)
    assert results["long0"][-1].finish_reason == "abort"
    assert results["queued"][-1].finish_reason == "length" and results["long1"][-1].finish_reason == "length"
    assert not engine.has_unfinished() and engine.pool.allocator.num_used == engine.reserved_slots
