"""run_point against a real stack: the JSON line carries every field the bench contract and BENCHMARKS.md
name, and its figures are the ones worked out here from the per-request records it wrote."""
from __future__ import annotations

import datetime
import json
import shlex
import sys

import numpy as np
import pytest

from bench.point import PointSpec, run_point
from shared.tiny_model import VOCAB_SIZE
from tests.bench.conftest import demo_model_for

CONTRACT_FIELDS = {
    "setting", "system", "n_adapters", "alpha", "req_rate", "cv", "policy", "throughput_rps", "output_tok_s",
    "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "latency_mean_s", "slo_attainment", "roofline_fraction", "gpu",
    "date", "command",
    # BENCHMARKS.md "Metrics" and the run's own parameters
    "n_requests", "duration_s", "warmup_s", "seed", "aborted", "ttft_p90_s", "tpot_mean_s", "user_satisfaction",
    "pool_kv_slots_peak", "pool_adapter_slots_peak", "pool_free_slots_min", "pool_total_slots", "adapter_loads",
    "adapter_load_bytes", "gpu_memory_used_peak_mib", "worker_steps",
}


def test_point_line_matches_its_records(core_stack, tmp_path):
    spec = PointSpec("tiny", "loraplex", n_adapters=4, alpha=0.5, req_rate=8.0, cv=2.0, policy="fcfs", duration_s=2.5,
                     warmup_s=0.5, seed=5, prompt_range=(4, 32), output_range=(24, 64))
    command = "loraplex bench run --setting tiny --n 4"
    point = run_point(core_stack.url, spec, demo_model_for, VOCAB_SIZE, command=command,
                      records_path=tmp_path / "records.jsonl", progress=False, sample_interval_s=0.2)
    assert CONTRACT_FIELDS <= point.keys(), CONTRACT_FIELDS - point.keys()
    assert json.loads(json.dumps(point, allow_nan=False)) == point  # one plain JSON line
    assert point["command"] == command and point["roofline_fraction"] is None
    assert point["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    import torch

    assert point["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    assert (point["setting"], point["system"], point["n_adapters"], point["alpha"], point["req_rate"], point["cv"],
            point["policy"], point["duration_s"], point["warmup_s"], point["seed"]) == (
            "tiny", "loraplex", 4, 0.5, 8.0, 2.0, "fcfs", 2.5, 0.5, 5)

    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    trace = spec.trace()
    assert point["n_requests"] == len(records) == len(trace) >= 8
    for r, t in zip(records, trace):
        assert r["error"] is None and r["arrival_s"] == t.arrival_s and r["adapter"] == t.adapter
        assert r["arrival_s"] <= r["sent_s"] <= r["first_token_s"] <= r["finish_s"]
        assert r["output_tokens"] == r["output_len"] == t.output_len

    window = [r for r in records if r["arrival_s"] >= 0.5]
    end = max([r["finish_s"] for r in window] + [2.5])
    ttft = np.array([r["first_token_s"] - r["arrival_s"] for r in window])
    assert point["n_window"] == len(window) and point["aborted"] == 0
    assert point["window_s"] == pytest.approx(end - 0.5)
    assert point["throughput_rps"] == pytest.approx(len(window) / (end - 0.5))
    assert point["output_tok_s"] == pytest.approx(sum(r["output_tokens"] for r in window) / (end - 0.5))
    assert point["latency_mean_s"] == pytest.approx(np.mean([r["finish_s"] - r["arrival_s"] for r in window]))
    assert point["ttft_mean_s"] == pytest.approx(ttft.mean())
    for q in (50, 90, 99):
        assert point[f"ttft_p{q}_s"] == pytest.approx(np.percentile(ttft, q))
    multi = [r for r in window if r["output_tokens"] > 1]
    assert point["tpot_mean_s"] == pytest.approx(np.mean([(r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1)
                                                          for r in multi]))
    assert point["slo_attainment"] == pytest.approx(np.mean(ttft <= 6.0))
    assert point["user_satisfaction"] == pytest.approx(np.mean(np.where(ttft < 6.0, 1 - (ttft / 6.0) ** 2, 0.0)))

    # The server's side was watched throughout (requests of 24+ tokens overlap, so the scheduler's view,
    # refreshed every 0.5 s, sees KV in use).
    assert point["metrics_samples"] >= 5 and point["metrics_sample_errors"] == 0
    assert 0 < point["pool_kv_slots_peak"] < point["pool_total_slots"]
    assert point["running_requests_peak"] >= 1 and point["adapter_loads"] >= 0 and point["adapter_load_bytes"] >= 0
    # and where its worker's time went: prompts were prefilled and tokens decoded.
    steps = point["worker_steps"]
    assert steps["prefill"]["steps"] >= 1 and steps["decode"]["steps"] >= 1 and steps["prefill"]["tokens"] >= 4
    # and over the measured window alone: part of the run's steps.
    window_steps = point["worker_steps_window"]
    assert window_steps is not None and sum(s["steps"] for s in window_steps.values()) >= 1
    for kind, s in window_steps.items():
        assert 0 <= s["steps"] <= steps[kind]["steps"] and 0 <= s["tokens"] <= steps[kind]["tokens"]
    # The GPU's busy share over the measured window is read from the samples inside it (none without a GPU).
    assert 0 <= point["gpu_busy_window_samples"] <= point["gpu_busy_samples"]
    assert (point["gpu_busy_window_mean"] is None) == (point["gpu_busy_window_samples"] == 0)


def test_default_command_is_this_process(core_stack):
    spec = PointSpec("tiny", "base-only", 0, 1.0, 10.0, 1.0, "fcfs", 0.4, 0.0, 1, (4, 8), (2, 4))
    point = run_point(core_stack.url, spec, lambda r: "model", VOCAB_SIZE, progress=False)
    assert point["command"] == shlex.join(sys.argv)
    assert point["n_adapters"] == 0 and point["n_completed"] == point["n_requests"]


def test_spec_rejects_a_warmup_past_the_run():
    with pytest.raises(ValueError, match="warmup_s"):
        PointSpec("tiny", "loraplex", 4, 1.0, 1.0, 1.0, "fcfs", duration_s=10.0, warmup_s=10.0, seed=0)


def test_the_server_code_fingerprint_follows_the_source_and_nothing_else(tmp_path):
    from bench.point import code_fingerprint, server_code, versions

    assert code_fingerprint(tmp_path) is None  # no server packages here
    (tmp_path / "services" / "gateway").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "services" / "gateway" / "app.py").write_text("A = 1\n")
    (tmp_path / "shared" / "config.py").write_text("B = 2\n")
    first = code_fingerprint(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "shared" / "notes.txt").write_text("not code")
    (tmp_path / "shared" / "__pycache__").mkdir()
    (tmp_path / "shared" / "__pycache__" / "config.py").write_text("compiled leftovers")
    assert code_fingerprint(tmp_path) == first
    (tmp_path / "shared" / "config.py").write_text("B = 3\n")
    assert code_fingerprint(tmp_path) not in (None, first)
    (tmp_path / "shared" / "config.py").write_text("B = 2\n")
    assert code_fingerprint(tmp_path) == first
    (tmp_path / "shared" / "config.py").rename(tmp_path / "shared" / "settings.py")
    assert code_fingerprint(tmp_path) != first  # a file's path is part of the code
    # Every point line carries this checkout's.
    assert versions()["server_code"] == server_code() and len(server_code()) == 12
