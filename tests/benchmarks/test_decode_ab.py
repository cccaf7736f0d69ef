"""The decode A/B benchmark runs two launch-shape settings in alternating rounds on one engine (CPU, tiny)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from bench import REPO, child_env


def run(tmp_path, *extra):
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode_ab", "--smoke", "--out", str(out), *extra],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    return proc, out


def test_smoke_run_times_both_settings_in_paired_rounds(tmp_path):
    proc, out = run(tmp_path, "--a", "graph_expand_tiles=2,graph_shrink_split=1", "--b", "")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["a"], result["b"], result["rounds"]) == ("graph_expand_tiles=2,graph_shrink_split=1", "", 2)
    first, last = result["longest_context"]
    assert first > result["prompt_len"] and last == first + 2 * 2 * (result["steps"] + 1) + 2
    a, b = result["step_ms"]["A"], result["step_ms"]["B"]
    assert len(a) == len(b) == 2 and all(t > 0 for t in a + b)
    assert result["median_ms"] == {"A": statistics.median(a), "B": statistics.median(b)}
    assert result["median_b_minus_a_ms"] == statistics.median([y - x for x, y in zip(a, b)])
    assert abs(result["b_over_a"] - statistics.median(b) / statistics.median(a)) < 1e-12
    assert "round 2/2:" in proc.stderr and "B / A" in proc.stdout
    # Four requests over three adapters, one each in turn: every decode step reads the three adapters' rows.
    assert result["adapters_a_step"] == 3 and result["adapter_rows_gb_a_step"] > 0


def test_an_unknown_word_fails_before_the_engine_is_built(tmp_path):
    proc, out = run(tmp_path, "--b", "graph_expand_tiles=3")
    assert proc.returncode != 0 and not out.exists()
    assert "graph_expand_tiles needs a power of two" in proc.stderr


def test_a_run_past_its_context_bucket_is_refused_before_timing():
    from benchmarks.decode_ab import check_one_context_bucket

    check_one_context_bucket(400, 100, 4096)  # 500 tokens: the 512-token bucket throughout
    check_one_context_bucket(600, 400, 4096)  # 1000: the 1024 bucket throughout
    check_one_context_bucket(3000, 5000, 4096)  # the page table's length caps the last bucket
    with pytest.raises(ValueError, match="past the graphs' 512-token context bucket"):
        check_one_context_bucket(470, 84, 4096)


def test_further_settings_share_the_engine_and_rotate_in_the_rounds(tmp_path):
    proc, out = run(tmp_path, "--b", "", "--b", "graph_few_expand_deal", "--b", "graph_expand_tiles=2")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["settings"] == {"A": "", "B": "", "C": "graph_few_expand_deal", "D": "graph_expand_tiles=2"}
    times = result["step_ms"]
    assert sorted(times) == ["A", "B", "C", "D"] and all(len(v) == 2 and min(v) > 0 for v in times.values())
    # Every setting's steps ran in the same rounds: four settings a round, each a warm-up step and two timed.
    first, last = result["longest_context"]
    assert last == first + 2 * 4 * (result["steps"] + 1) + 2
    for k in "BCD":
        assert result["median_minus_a_ms"][k] == statistics.median([x - a for a, x in zip(times["A"], times[k])])
        assert abs(result["over_a"][k] - statistics.median(times[k]) / statistics.median(times["A"])) < 1e-12
    assert (result["b"], result["b_over_a"]) == ("", result["over_a"]["B"])
    assert "round 2/2: A " in proc.stderr and ", D " in proc.stderr and "D / A" in proc.stdout


def test_a_batch_the_pool_cannot_hold_stops_at_its_first_preemption(tmp_path):
    # 500 slots hold the tiny model's three adapters but not four requests' KV beside them: without the check
    # the preempted requests are prefilled again and preempt others in turn until the run is killed.
    proc, out = run(tmp_path, "--slots", "500")
    assert proc.returncode != 0 and not out.exists()
    assert "the pool's 500 slots cannot hold 4 requests of 8 prompt tokens" in proc.stderr
    assert "lower --batch or --prompt-len" in proc.stderr and "round 1/" not in proc.stderr
    # The same run with room for the batch times its rounds.
    proc, out = run(tmp_path, "--slots", "2000")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["rounds"] == 2
