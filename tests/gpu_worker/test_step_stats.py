"""The engine counts its steps by kind, with their time and tokens (services/gpu_worker/step_stats.py)."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from services.gpu_worker.requests import StepInFlight
from services.gpu_worker.step_stats import STEP_KINDS, StepStats, step_gpu_seconds, step_kind
from shared.config import EngineConfig
from shared.tiny_model import make_model


def test_record_adds_up_by_kind_and_refuses_unknown_kinds():
    stats = StepStats()
    assert stats.steps == {"graph": 0, "decode": 0, "prefill": 0}
    stats.record("prefill", started=10.0, tokens=12, now=10.25, launched=10.125)
    stats.record("decode", started=11.0, tokens=2, now=11.5, launched=11.25)
    stats.record("decode", started=12.0, tokens=2, now=12.25, adapters=3, adapter_bytes=3000)  # no launch time
    assert stats.steps == {"graph": 0, "decode": 2, "prefill": 1}
    assert stats.seconds == {"graph": 0.0, "decode": 0.75, "prefill": 0.25}
    assert stats.tokens == {"graph": 0, "decode": 4, "prefill": 12}
    assert stats.launch == {"graph": 0.0, "decode": 0.25, "prefill": 0.125}
    assert stats.adapters == {"graph": 0, "decode": 3, "prefill": 0}
    assert stats.adapter_bytes == {"graph": 0, "decode": 3000, "prefill": 0}
    with pytest.raises(ValueError, match="unknown step kind 'eager'"):
        stats.record("eager", started=0.0, tokens=1)
    # Separate instances share nothing.
    assert StepStats().steps["decode"] == 0


def test_a_step_launched_ahead_counts_from_the_end_of_the_step_before():
    stats = StepStats()
    stats.record("graph", started=0.0, tokens=4, now=0.030, launched=0.002)
    # Scheduled at 0.010, while the step above ran; launched by 0.045, 15 ms after that step's tokens came.
    stats.record("prefill", started=0.010, tokens=900, now=0.120, launched=0.045, ahead=True)
    # Launched entirely behind the prefill step: none of its launch is exposed.
    stats.record("graph", started=0.100, tokens=4, now=0.150, launched=0.101, ahead=True)
    assert stats.seconds["prefill"] == pytest.approx(0.090) and stats.launch["prefill"] == pytest.approx(0.015)
    assert stats.seconds["graph"] == pytest.approx(0.030 + 0.030) and stats.launch["graph"] == pytest.approx(0.002)
    assert sum(stats.seconds.values()) == pytest.approx(0.150)  # the wall time, steps overlapping or not
    assert stats.ahead == {"graph": 1, "decode": 0, "prefill": 1}


class _Event:
    """A CUDA timing event's two calls step_gpu_seconds makes (elapsed_time in ms), for the CPU."""

    def __init__(self, at_ms: float, passed: bool = True):
        self.at_ms, self.passed = at_ms, passed

    def elapsed_time(self, end: "_Event") -> float:
        return end.at_ms - self.at_ms

    def query(self) -> bool:
        return self.passed


def test_gpu_time_is_summed_over_the_steps_timed_and_others_are_left_out():
    def flight(events):
        return StepInFlight([], gpu_events=events)

    timed, pending = flight((_Event(5.0), _Event(27.5))), flight((_Event(0.0), _Event(9.0, passed=False)))
    assert step_gpu_seconds(timed) == pytest.approx(0.0225) and step_gpu_seconds(pending) is None
    assert step_gpu_seconds(flight(None)) is None  # the CPU: no events
    stats = StepStats()
    stats.record("graph", started=0.0, tokens=8, now=0.030, gpu_s=step_gpu_seconds(timed))
    stats.record("graph", started=0.030, tokens=8, now=0.060, gpu_s=step_gpu_seconds(pending))
    stats.record("prefill", started=0.060, tokens=80, now=0.160)
    assert stats.steps["graph"] == 2 and stats.gpu_steps == {"graph": 1, "decode": 0, "prefill": 0}
    assert stats.gpu_seconds["graph"] == pytest.approx(0.0225) and stats.gpu_seconds["prefill"] == 0.0


def test_step_kind():
    assert step_kind(replayed=True, decode_only=True) == "graph"
    assert step_kind(replayed=False, decode_only=True) == "decode"
    assert step_kind(replayed=False, decode_only=False) == "prefill"
    assert set(STEP_KINDS) == {"graph", "decode", "prefill"}


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_counts_a_prefill_step_then_decode_steps(tmp_path, overlap):
    engine = Engine.from_model_dir(make_model(tmp_path / "model", preset="tiny", seed=2),
                                   EngineConfig(overlap_steps=overlap))
    engine.add_request(EngineRequest("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True)))
    engine.add_request(EngineRequest("b", [3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True)))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    stats = engine.capacity()["step_stats"]
    # One step prefills both prompts (12 tokens) and samples their first tokens; three decode steps of two
    # tokens sample the rest. The CPU has no graphs.
    assert stats.steps == {"graph": 0, "decode": 3, "prefill": 1} and steps == 4
    assert stats.tokens == {"graph": 0, "decode": 6, "prefill": 12}
    assert stats.seconds["graph"] == 0.0 and stats.seconds["prefill"] > 0 and stats.seconds["decode"] > 0
    # The launch is part of each step's time (on the CPU kernels run as they are launched: most of it).
    assert 0 < stats.launch["prefill"] <= stats.seconds["prefill"]
    if overlap:
        # Each decode step was launched (and on the CPU run) before the step before it had ended: none of
        # its launch is left in its own time.
        assert stats.ahead == {"graph": 0, "decode": 3, "prefill": 0} and stats.launch["decode"] == 0
    else:
        assert stats.ahead == {"graph": 0, "decode": 0, "prefill": 0}
        assert 0 < stats.launch["decode"] <= stats.seconds["decode"]


def test_a_step_counts_the_distinct_adapters_it_reads_and_their_bytes(tmp_path):
    from shared.adapter_format import load_adapter
    from shared.make_adapters import make_adapters
    from shared.model_config import MODULES

    from services.gpu_worker.adapter_layout import lora_read_bytes

    model_dir = make_model(tmp_path / "model", preset="tiny", seed=2)
    engine = Engine.from_model_dir(model_dir, EngineConfig(overlap_steps=False))
    cfg = engine.cfg
    dirs = make_adapters(tmp_path / "adapters", model_dir, 2, ranks=[8, 4], seed=3)
    read = {}
    for name, folder in zip(("r8", "r4"), dirs):
        packed = engine.register_adapter(name, load_adapter(folder, cfg, 8))
        read[name] = lora_read_bytes(packed.ranks, cfg, packed.rows.element_size())
    # Rank r on every module reads r rows of A and of Bᵀ, at their true lengths, per layer (bf16 or fp32).
    width = sum(sum(cfg.module_dims(m)) for m in MODULES)
    assert read["r8"] == 2 * read["r4"] == 8 * width * cfg.num_layers * packed.rows.element_size()
    # Three requests on two adapters and one on the base model; "a" and "b" share r8. "b" ends first.
    for rid, adapter, outputs in (("a", "r8", 4), ("b", "r8", 2), ("c", "r4", 4), ("base", None, 4)):
        engine.add_request(EngineRequest(rid, [5, 6, 7], SamplingParams(max_tokens=outputs, ignore_eos=True),
                                         adapter=adapter))
    while engine.has_unfinished():
        engine.step()
    stats = engine.capacity()["step_stats"]
    # The prefill step and the first decode step read both adapters (the base request reads none); after "b"
    # ends "a" still holds r8, so every decode step reads both.
    assert stats.steps == {"graph": 0, "decode": 3, "prefill": 1}
    assert stats.adapters == {"graph": 0, "decode": 6, "prefill": 2}
    both = read["r8"] + read["r4"]
    assert stats.adapter_bytes == {"graph": 0, "decode": 3 * both, "prefill": both}


def test_a_base_only_step_reads_no_adapter(tmp_path):
    engine = Engine.from_model_dir(make_model(tmp_path / "model", preset="tiny", seed=2), EngineConfig())
    engine.add_request(EngineRequest("base", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    stats = engine.capacity()["step_stats"]
    assert sum(stats.steps.values()) == 3
    assert stats.adapters == stats.adapter_bytes == {"graph": 0, "decode": 0, "prefill": 0}


def test_a_step_counts_the_keys_its_rows_attend_and_the_rows_it_samples(tmp_path):
    engine = Engine.from_model_dir(make_model(tmp_path / "model", preset="tiny", seed=2),
                                   EngineConfig(overlap_steps=False, max_batched_tokens=6))
    # A prompt of 9 tokens in chunks of 6 and 3 (the budget), beside one of 2 admitted with the second chunk.
    engine.add_request(EngineRequest("long", list(range(3, 12)), SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.step()
    engine.add_request(EngineRequest("short", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    stats = engine.capacity()["step_stats"]
    # Prefill: chunk 1 attends 1+2+...+6 = 21 pairs, chunk 2 (positions 7..9) 7+8+9 = 24 beside "short"'s
    # 1+2 = 3; only the second step samples (both requests' first tokens).
    assert stats.steps["prefill"] == 2 and stats.prompt_pairs["prefill"] == 21 + 24 + 3
    assert stats.decode_keys["prefill"] == 0 and stats.sampled["prefill"] == 2
    # Two decode steps of both rows: "long" reads 10 then 11 keys, "short" 3 then 4.
    assert stats.steps["decode"] == 2 and stats.decode_keys["decode"] == 10 + 11 + 3 + 4
    assert stats.prompt_pairs["decode"] == 0 and stats.sampled["decode"] == 4
