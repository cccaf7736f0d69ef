"""A kind of step's floor: each operation at the ceiling that binds it (bench/step_floor.py), written out by
hand for Llama-2-7B shapes at round ceilings."""
import pytest

from bench.roofline import Ceilings
from bench.settings import get_setting
from bench.step_floor import floor_seconds, window_steps, with_floors

S2 = get_setting("S2")
CEIL = Ceilings(device="cuda", name="test", hbm_gbs=4000.0, matmul_tflops=800.0, h2d_gbs=50.0, copy_bytes=0,
                matmul_n=0, matmul_dtype="bfloat16", pinned=True)
LINEAR = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # Llama-2-7B's linear weights
HEAD = 4096 * 32000


def test_decode_steps_past_the_ridge_take_their_gemms_flops_and_their_kv_bytes():
    # 100 decode steps of 384 rows, contexts of 400, each row sampled, 5 GB of adapter rows in all.
    counts = {"steps": 100, "tokens": 38_400, "decode_keys": 38_400 * 400, "prompt_pairs": 0, "sampled": 38_400,
              "adapter_bytes": 5e9}
    parts = floor_seconds(S2, CEIL, counts)
    # 384 tokens a step is past the ridge (200 FLOPs a byte): the linears' FLOPs, not their bytes.
    assert parts["linears"] == pytest.approx(100 * 2 * LINEAR * 384 / 800e12)
    assert parts["lm_head"] == pytest.approx(100 * 2 * HEAD * 384 / 800e12)
    # K and V of every layer, 2 bytes each, for every context token every row reads.
    assert parts["decode_attention"] == pytest.approx(38_400 * 400 * 32 * 2 * 4096 * 2 / 4000e9)
    assert parts["prompt_attention"] == 0 and parts["lora"] == pytest.approx(5e9 / 4000e9)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


def test_small_steps_take_their_weights_bytes_and_prompts_their_attention_flops():
    counts = {"steps": 10, "tokens": 10 * 64, "decode_keys": 0, "prompt_pairs": 10 * 64 * 65 // 2, "sampled": 10,
              "adapter_bytes": 0}
    parts = floor_seconds(S2, CEIL, counts)
    assert parts["linears"] == pytest.approx(10 * LINEAR * 2 / 4000e9)  # 64 tokens: below the ridge
    assert parts["lm_head"] == pytest.approx(10 * HEAD * 2 / 4000e9)
    assert parts["prompt_attention"] == pytest.approx(10 * 64 * 65 // 2 * 4 * 4096 * 32 / 800e12)
    with pytest.raises(ValueError, match="no steps"):
        floor_seconds(S2, CEIL, {**counts, "steps": 0})


def test_worker_steps_get_floors_where_they_recorded_the_counters():
    recorded = {"steps": 100, "tokens": 38_400, "decode_keys": 38_400 * 400, "prompt_pairs": 0, "sampled": 38_400,
                "adapter_bytes": 5e9, "mean_ms": 30.0}
    steps = {"graph": recorded,
             "decode": {"steps": 0, "tokens": 0, "mean_ms": None},  # never ran
             "prefill": {"steps": 10, "tokens": 30_000, "mean_ms": 100.0}}  # an older line: no counters
    out = with_floors(steps, S2, CEIL)
    floor_ms = 1e3 * floor_seconds(S2, CEIL, recorded)["total"] / 100
    assert out["graph"]["floor_ms"] == pytest.approx(floor_ms, abs=1e-3)
    assert out["graph"]["of_floor"] == pytest.approx(floor_ms / 30.0, abs=1e-4)
    assert "floor_ms" not in out["decode"] and "floor_ms" not in out["prefill"]
    assert "floor_ms" not in steps["graph"]  # the line given is left as it was
    assert with_floors(None, S2, CEIL) is None


def test_an_engines_steps_between_two_readings_are_recorded_as_a_points():
    import copy

    from services.gpu_worker.step_stats import StepStats

    stats = StepStats()
    stats.record("prefill", started=0.0, tokens=100, now=0.05, prompt_pairs=5050, sampled=1)
    stats.record("graph", started=0.1, tokens=8, now=0.9, sampled=8, captures=1, capture_s=0.7)
    before = copy.deepcopy(stats)
    for i in range(4):
        stats.record("decode", started=1.0 + i, tokens=8, now=1.02 + i, decode_keys=8 * 200, sampled=8,
                     adapters=3 + i % 2, adapter_bytes=10**6)
    stats.record("graph", started=5.0, tokens=8, now=5.6, sampled=8, captures=1, capture_s=0.5, gpu_s=0.55,
                 builds=2, build_s=0.3)
    window = window_steps(before, stats)
    # The window's own captures: the one before it is left out.
    assert (window["graph"]["captures"], window["graph"]["capture_s"]) == (1, pytest.approx(0.5))
    assert window["decode"]["captures"] == 0
    # Kernels built while the window's steps were issued, by kind.
    assert (window["graph"]["builds"], window["graph"]["build_s"]) == (2, pytest.approx(0.3))
    assert window["decode"]["builds"] == 0
    # The GPU's time of the window's one timed step; none timed among the decode steps.
    assert window["graph"]["gpu_ms"] == pytest.approx(550.0) and window["decode"]["gpu_ms"] is None
    assert window["prefill"]["steps"] == 0 and window["prefill"]["mean_ms"] is None
    assert window["prefill"]["adapters_mean"] is None and window["decode"]["adapters_mean"] == pytest.approx(3.5)
    decode = window["decode"]
    assert (decode["steps"], decode["tokens"], decode["decode_keys"], decode["sampled"]) == (4, 32, 6400, 32)
    assert decode["adapter_bytes"] == 4 * 10**6 and decode["mean_ms"] == pytest.approx(20.0)
    floored = with_floors(window, S2, CEIL)["decode"]
    assert floored["floor_ms"] > 0 and floored["of_floor"] == pytest.approx(floored["floor_ms"] / 20.0, abs=1e-4)
