"""The engine-alone trace runs end to end on the CPU (tiny model), gives its window's steps their floors and
profiles steps after it, on the GPU and on the host."""
from __future__ import annotations

import json
import subprocess
import sys

from bench import REPO, child_env


def test_smoke_run_reports_throughput_and_each_kinds_floor(tmp_path):
    out = tmp_path / "trace.jsonl"
    # Enough requests that a fast machine does not finish them all inside the second of warm-up (60 did); the
    # run stops after its two measured seconds whatever is left.
    table = tmp_path / "profile.txt"  # then 4 more steps profiled after the window
    proc = subprocess.run([sys.executable, "benchmarks/engine_trace.py", "--smoke", "--adapters", "3", "--requests",
                           "600", "--seconds", "2", "--warmup", "1", "--out", str(out), "--worker-warmup",
                           "--profile-steps", "4",
                           "--profile-out", str(table), "--host-profile-steps", "3", "--host-profile-out",
                           str(tmp_path / "host.txt")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["model"] == "tiny" and result["ceilings"]["device"] == "cpu"
    steps = result["steps"]
    ran = {kind: s for kind, s in steps.items() if s["steps"]}
    assert "decode" in ran and steps["graph"]["steps"] == 0  # no graphs on the CPU
    for kind, s in ran.items():
        assert s["mean_ms"] > 0 and s["floor_ms"] > 0, kind
        assert abs(s["of_floor"] - s["floor_ms"] / s["mean_ms"]) < 1e-3
    # Decode rows read their contexts and sample; requests name the three adapters, whose rows steps read.
    assert ran["decode"]["decode_keys"] > ran["decode"]["tokens"] == ran["decode"]["sampled"]
    assert ran["decode"]["adapter_bytes"] > 0
    assert 1 <= ran["decode"]["adapters_mean"] <= 3
    # Kernel builds are watched; under the CPU interpreter nothing is built.
    assert result["kernel_builds"] == {"builds": 0, "seconds": 0, "by_kernel": {}}
    assert result["kernel_builds_window"]["builds"] == 0
    # The worker's own warm-up ran first, as before a served worker reports ready.
    assert result["worker_warmup"]["seconds"] > 0 and result["worker_warmup"]["kernel_builds"]["builds"] == 0
    # The profiled steps wrote their table: the steps' own operations, on the CPU.
    profiled = result["profiled"]
    assert sum(profiled["steps"].values()) == 4 and profiled["wall_ms_a_step"] > 0
    text = table.read_text()
    assert text.startswith("4 steps (0 graph, 4 eager)") and "aten::mm" in text
    # Then 3 steps under cProfile: the host's functions, the engine's step among them, by own and total time.
    host = result["host_profiled"]
    assert host["steps"] == {"graph": 0, "eager": 3} and host["ms_a_step"]["eager"] > 0
    text = (tmp_path / "host.txt").read_text()
    assert text.startswith("3 steps (0 graph, 3 eager)") and "finish_step" in text
    assert "by tottime" in text and "by cumulative" in text



def test_profiling_without_a_place_for_its_table_is_refused_before_the_engine_loads(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/engine_trace.py", "--smoke", "--profile-steps", "4",
                           "--out", str(tmp_path / "trace.jsonl")], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "--profile-steps needs --profile-out" in proc.stderr
