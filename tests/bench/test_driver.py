"""The sweep driver: a spec expanded to points grouped by stack, pieces planned into a wall-time budget, one
JSON line per point, resumable without running a point twice. The two-piece sweep runs the real command
(`loraplex bench sweep`) against real tiny stacks on the CPU."""
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench import REPO, child_env
from bench.driver import Driver, SweepSpec, expand, groups, point_key, point_model_for


TWO_POINTS = {
    "name": "tiny-two", "setting": "tiny", "systems": ["loraplex", "base-only"], "n": [2, 3],
    "by_system": {"base-only": {"n": [3]}}, "rates": [3],
    "duration_s": 3, "warmup_s": 0.5, "prompt_range": [4, 12], "output_range": [2, 6], "device": "cpu",
    # Estimates that fit one stack in a 100 s piece and not two: 1 s start + 46 s warm-up traffic (1 s of it,
    # its tail estimated at 45) + 1 s stop, then 48 s for its first point: 96 s, more than a piece has left
    # once its first stack has started and measured (those take seconds on a CPU). A started stack's further
    # points go by the clock.
    "stack_warmup_s": 1, "startup_s": 1, "point_tail_s": 45, "stop_s": 1, "request_timeout_s": 60,
}


def sweep(spec_path: Path, work: Path, out: Path, budget: float) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--budget-s",
                           str(budget), "--work-dir", str(work), "--out-dir", str(out), "--quiet"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def results(out: Path) -> list[dict]:
    path = out / "tiny-two.jsonl"
    return [json.loads(t) for t in path.read_text().splitlines()] if path.is_file() else []


def test_a_sweep_runs_in_two_pieces_and_resumes_without_repeating(tmp_path):
    # loraplex n = 2 and 3 and base-only share one stack; bmm needs a stack of its own.
    # A 60 s start estimate: a stack and its first point need 60 + 46 + 1 + 48 = 155 s, so the first piece's
    # 163 s fit one stack with 8 s to spare (its check comes before any work) and never a second, while its
    # later points (49 s each by the estimate) still run up to 114 s into the piece on a slow machine.
    spec = {**TWO_POINTS, "systems": ["loraplex", "base-only", "bmm"], "startup_s": 60,
            "by_system": {"base-only": {"n": [3]}, "bmm": {"n": [2]}}}
    spec_path = tmp_path / "tiny-two.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    work, out = tmp_path / "work", tmp_path / "out"

    first = sweep(spec_path, work, out, budget=163)
    assert first.returncode == 3, first.stdout + first.stderr
    assert "run the same command again" in first.stdout and "a bmm stack and its first point" in first.stdout
    assert "warm-up: 1 s of traffic at 3 req/s, not measured" in first.stderr
    lines = results(out)
    # Estimated at 48 s each, the stack's later points ran because the clock said they fit.
    assert [(x["system"], x["n_adapters"]) for x in lines] == [("loraplex", 2), ("loraplex", 3), ("base-only", 3)]
    assert len(list((work / "logs").iterdir())) == 1
    # base-only ran on the loraplex stack, every request on the base model.
    assert lines[2]["stack_command"] == lines[1]["stack_command"]
    base_records = (work / "records" / "tiny-two").glob("*base-only*")
    models = {json.loads(t)["model"] for f in base_records for t in f.read_text().splitlines() if t.strip()}
    assert models == {"tiny-llama"}, models

    second = sweep(spec_path, work, out, budget=200)
    assert second.returncode == 0, second.stdout + second.stderr
    lines = results(out)
    assert [(x["system"], x["n_adapters"]) for x in lines][3:] == [("bmm", 2)]
    assert len({x["key"] for x in lines}) == 4 and len(list((work / "logs").iterdir())) == 2

    third = sweep(spec_path, work, out, budget=200)
    assert third.returncode == 0 and "0 points measured" in third.stdout
    assert len(results(out)) == 4 and len(list((work / "logs").iterdir())) == 2  # no stack started

    for x in lines:
        assert x["setting"] == "tiny" and x["policy"] == "early-abort"
        # The worker's counters over the point: a roomy pool preempted nothing and computed nothing twice.
        assert x["preemptions"] == 0 and x["recomputed_tokens"] == 0
        assert x["n_completed"] > 0 and x["throughput_rps"] > 0
        assert 0 < x["roofline_fraction"] == pytest.approx(x["throughput_rps"] / x["roofline_rps"])
        assert 0 < x["attainable_rps"] <= x["roofline_rps"]
        # The roofline at the matmul rate held under load, beside it (the CPU's rate, so either side of it).
        held = x["ceilings"]["matmul_held_tflops"]
        assert held > 0 and x["roofline_rps_held"] > 0
        assert x["roofline_fraction_held"] == pytest.approx(x["throughput_rps"] / x["roofline_rps_held"])
        assert (x["roofline_rps_held"] < x["roofline_rps"]) == (held < x["ceilings"]["matmul_tflops"])
        # Each kind of step that ran got its floor from the worker's counters and the run's ceilings.
        ran = [s for s in x["worker_steps"].values() if s["steps"]]
        assert ran and all(s["floor_ms"] > 0 and s["of_floor"] == pytest.approx(s["floor_ms"] / s["mean_ms"], abs=1e-3)
                           for s in ran)
        # so did those of the measured window alone (2.5 s of a 3 s point, sampled every 0.5 s).
        in_window = [s for s in x["worker_steps_window"].values() if s["steps"]]
        assert in_window and all(s["floor_ms"] > 0 for s in in_window)
        assert x["ceilings"]["device"] == "cpu" and x["gpu"] == "cpu"
        assert x["command"].startswith("loraplex bench sweep") and "--budget-s" in x["command"]
        assert "scheduler.queue_order=auto" in x["stack_command"]
        # CPU time of each service during the point, for where the serving path's time goes.
        assert {"gateway", "scheduler", "adapter_store", "worker-0"} <= set(x["service_cpu_s"])
        assert x["service_cpu_s"]["gateway"] > 0 and x["service_cpu_s"]["worker-0"] > 0
        assert all(v >= 0 for v in x["service_cpu_cores"].values())
    # The first stack registered the largest n of its points; the second piece's stack found them in the
    # data dir.
    assert (lines[0]["registration"]["created"], lines[0]["registration"]["already"]) == (3, 0)
    assert lines[3]["registration"]["created"] == 0 and lines[3]["registration"]["already"] >= 2
    assert (work / "records" / "tiny-two").is_dir()
    # Each command is one run: the first piece's three lines name one, the second piece's line another.
    assert lines[0]["run"] == lines[1]["run"] == lines[2]["run"] != lines[3]["run"]
    assert datetime.datetime.fromisoformat(lines[0]["run"]).tzinfo is not None


def test_a_point_running_past_the_budget_is_cut_off_and_its_tail_remembered(tmp_path):
    # Estimates say the point fits (1 s of tail); its real backlog (600 requests of 400-500 tokens on a
    # CPU; an idle 2-core machine served 180 of them in 27 s) would take minutes. The piece must end on time
    # anyway, with no line for the cut point.
    spec = {**TWO_POINTS, "systems": ["loraplex"], "by_system": {}, "n": [2], "rates": [200],
            "output_range": [400, 500], "stack_warmup_s": 0, "point_tail_s": 1}
    spec_path = tmp_path / "tiny-two.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    work, out = tmp_path / "work", tmp_path / "out"
    budget = 30
    started = time.monotonic()
    piece = sweep(spec_path, work, out, budget=budget)
    took = time.monotonic() - started
    assert piece.returncode == 3, piece.stdout + piece.stderr
    assert "tiny/loraplex/n=2/" in piece.stdout and "ran past the budget" in piece.stdout, piece.stdout
    assert results(out) == []
    assert took < budget + 20, took  # the budget, then the stack's stop
    tail = json.loads((work / "timings.json").read_text())["point_tail"]["tiny/loraplex"]
    assert tail > 1  # what the cut point had already taken beyond its arrivals: later plans reserve it


def test_spec_expands_to_points_grouped_by_stack():
    spec = SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "base-only", "peft"],
                                "n": [5, 100], "rates": [10, 20], "cvs": 1, "policies": ["early-abort", "fcfs"]})
    points = expand(spec)
    assert len(points) == 3 * 2 * 2 * 2
    keys = [key for key, _ in groups(points)]
    # base-only runs on the loraplex stack (one per policy, every n); peft: one per n as well.
    assert keys == [("S2", "loraplex", None, "early-abort"), ("S2", "loraplex", None, "fcfs"),
                    ("S2", "peft", 5, "early-abort"), ("S2", "peft", 5, "fcfs"),
                    ("S2", "peft", 100, "early-abort"), ("S2", "peft", 100, "fcfs")]
    assert len({point_key(p) for p in points}) == len(points)
    first = dict(groups(points))[("S2", "loraplex", None, "early-abort")]
    # n by n: the systems' comparison at the first n comes before the next n.
    assert [(p.system, p.n_adapters) for p in first if p.req_rate == 10] == [
        ("loraplex", 5), ("base-only", 5), ("loraplex", 100), ("base-only", 100)]


def test_a_system_can_have_its_own_n_list_timeout_and_tail(tmp_path):
    spec = SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "base-only", "peft"],
                                "n": [100, 5, 2000], "rates": [40], "duration_s": 140, "point_tail_s": 20,
                                "by_system": {"base-only": {"n": [100]},
                                              "peft": {"n": 100, "request_timeout_s": 60, "point_tail_s": 70}}})
    points = expand(spec)
    assert [(p.system, p.n_adapters) for p in points] == [
        ("loraplex", 100), ("base-only", 100), ("peft", 100), ("loraplex", 5), ("loraplex", 2000)]
    assert (spec.own("peft", "request_timeout_s"), spec.own("loraplex", "request_timeout_s")) == (60, 300.0)
    driver = Driver(spec, tmp_path / "work", tmp_path / "x.jsonl", progress=False)
    assert [driver.point_estimate(p) for p in points[:3]] == [160, 160, 210]
    for bad, message in [({"bmm": {"n": [5]}}, "not in systems"), ({"peft": {"n": [-1]}}, "integers >= 0"),
                         ({"peft": {"rates": [4]}}, "unknown field"), ({"peft": [5]}, "unknown field"),
                         ({"peft": {"request_timeout_s": 0}}, "must be > 0"), ([5], "maps a system")]:
        with pytest.raises(ValueError, match=message):
            SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "peft"], "n": [5],
                                 "rates": [40], "by_system": bad})


def test_a_stack_starts_only_if_its_start_first_point_and_stop_fit_in_the_time_left(tmp_path):
    spec = SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "bmm"], "n": [5, 100],
                                "rates": [10], "duration_s": 100, "startup_s": 50, "point_tail_s": 20, "stop_s": 10})
    driver = Driver(spec, tmp_path / "work", tmp_path / "x.jsonl", budget_s=181, progress=False)
    first = [expand(spec)[0]]
    # 50 + 10 + 120 = 180, and 5 adapters to register at 0.025 s each
    assert driver.stack_fits("loraplex", first) == ""
    # A host that has been slower raises the estimates: then the stack waits for the next piece.
    driver.timings.note("startup", "S2/loraplex", 52.0)
    why = driver.stack_fits("loraplex", first)
    assert "loraplex stack and its first point need ~182 s" in why and "~181 s of the budget are left" in why
    assert driver.stack_fits("bmm", first) == ""  # estimates are kept per system


def test_a_stack_counts_the_adapters_its_registry_lacks(tmp_path):
    from bench.adapters import Registration

    spec = SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "base-only"], "n": [2000],
                                "rates": [10], "duration_s": 100, "startup_s": 50, "point_tail_s": 20, "stop_s": 10})
    driver = Driver(spec, tmp_path / "work", tmp_path / "x.jsonl", budget_s=300, progress=False)
    # A fresh host: all 2000 to register, at 0.025 s each until it has timed its own.
    assert driver.registration_estimate("loraplex", 2000) == pytest.approx(50.0)
    assert driver.startup_estimate("loraplex", 2000) == pytest.approx(100.0)
    assert driver.registration_estimate("base-only", 2000) == 0.0  # serves no adapter
    assert driver.stack_fits("loraplex", expand(spec)[:1]) == ""  # 50 + 50 + 10 + 120 = 230 of 300
    tight = Driver(spec, tmp_path / "work", tmp_path / "x.jsonl", budget_s=229, progress=False)
    assert "loraplex stack and its first point need ~230 s" in tight.stack_fits("loraplex", expand(spec)[:1])
    # A registration stopped short says nothing of what the registry holds.
    driver.note_registration(2000, Registration(requested=2000, created=900, seconds=30.0, stopped_at_deadline=True))
    assert driver.registration_estimate("loraplex", 2000) == pytest.approx(50.0)
    # A complete one, slower than the default: the registry holds them all while its folder stands; a
    # larger population registers the rest at the rate this host took.
    driver.note_registration(2000, Registration(requested=2000, created=2000, seconds=80.0))
    driver.registry().mkdir(parents=True)
    assert driver.registration_estimate("loraplex", 2000) == 0.0
    assert driver.registration_estimate("loraplex", 3000) == pytest.approx(40.0)  # 1000 at 0.04 s
    # Its data folder gone (a fresh host with the old timings), every adapter is to register again.
    driver.registry().rmdir()
    assert driver.registration_estimate("loraplex", 2000) == pytest.approx(80.0)


def test_a_stack_is_not_started_once_the_piece_has_spent_the_time_its_estimates_needed(tmp_path):
    # The estimates fit a stack and its point in a fresh 100 s piece (1 s start, 1 s stop, 3 + 1 s point); the
    # ceilings and the adapters' generation come between that check and the stack's start. Checked again there
    # with 5 s left, the stack is left for the next piece instead of being cut off at the budget with no line.
    from bench.driver import PieceResult

    spec = SweepSpec.from_dict({**TWO_POINTS, "systems": ["loraplex"], "by_system": {}, "n": [2],
                                "stack_warmup_s": 0, "point_tail_s": 1})
    work = tmp_path / "work"
    driver = Driver(spec, work, tmp_path / "x.jsonl", budget_s=100, progress=False)
    (_, system, n, policy), group = groups(expand(spec))[0]
    assert driver.stack_fits(system, group) == ""
    driver.started -= 95  # what the piece has spent since
    why = driver.run_group(system, n, policy, None, group, None, PieceResult(ran=[], remaining=1, total=1))
    assert "a loraplex stack and its first point need ~6 s" in why and "~5 s of the budget are left" in why
    assert not (work / "logs").exists()  # no stack was started


@pytest.mark.parametrize("values,message", [
    ({"setting": "S2", "systems": ["loraplex"], "n": [5], "rates": [10], "colour": "red"}, "unknown sweep field"),
    ({"setting": "S2", "systems": ["vllm"], "n": [5], "rates": [10]}, "unknown system"),
    ({"setting": "S2", "systems": ["loraplex"], "n": [5], "rates": [10], "policies": ["sjf"]}, "admission policy"),
    ({"setting": "S2", "systems": ["loraplex"], "n": [5]}, "lacks rates"),
    ({"setting": "S2", "systems": ["loraplex"], "n": [5], "rates": [10], "warmup_s": 200}, "warmup_s"),
    ({"setting": "S2", "systems": ["loraplex"], "n": [5], "rates": [10],
      "set": ["worker.max_running_requests=many"]}, "max_running_requests must be an integer"),
])
def test_bad_specs_are_refused_naming_the_problem(values, message):
    with pytest.raises(ValueError, match=message):
        SweepSpec.from_dict(values, default_name="bad")


def test_the_roofline_batch_follows_the_stacks_running_batch():
    base = {"name": "x", "setting": "S-GQA", "systems": ["loraplex"], "n": [5], "rates": [10]}
    assert SweepSpec.from_dict(base).max_running == 256
    spec = SweepSpec.from_dict({**base, "set": ["worker.max_batched_tokens=8192", "worker.max_running_requests=512"]})
    assert spec.max_running == 512


def test_every_shipped_spec_loads():
    for path in sorted((REPO / "bench" / "sweeps").glob("*.yaml")):
        spec = SweepSpec.load(path)
        assert spec.name == path.stem and expand(spec)


def test_a_piece_stopped_by_sigterm_stops_its_stack(tmp_path):
    import signal
    import time

    from shared.probes import alive, descendants

    spec_path = tmp_path / "tiny-two.yaml"
    spec_path.write_text(yaml.safe_dump({**TWO_POINTS, "n": [2], "duration_s": 60}))
    env = child_env(OMP_NUM_THREADS="1")
    driver = subprocess.Popen([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--work-dir",
                               str(tmp_path / "work"), "--out-dir", str(tmp_path / "out"), "--quiet"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        seen: set[int] = set()
        # Wait until the stack is up (its launcher's log says ready) and the point under way.
        while time.monotonic() < deadline:
            seen.update(descendants(driver.pid))
            logs = list((tmp_path / "work" / "logs").glob("*.log")) if (tmp_path / "work" / "logs").is_dir() else []
            if logs and "loraplex.ready" in logs[0].read_text(errors="replace"):
                break
            assert driver.poll() is None, driver.stdout.read().decode()
            time.sleep(0.2)
        time.sleep(1.0)
        seen.update(descendants(driver.pid))
        assert len(seen) >= 5  # launcher, redis, store, scheduler, worker, gateway
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 10
    while [p for p in seen if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in seen if alive(p)] == []
    assert not (tmp_path / "out" / "tiny-two.jsonl").exists()  # the cut point left no line


def test_since_measures_again_what_was_measured_before_it(tmp_path):
    from bench.driver import done_keys

    spec = {"name": "again", "setting": "S2", "systems": ["loraplex"], "n": [5, 100], "rates": [40]}
    spec_path = tmp_path / "again.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    keys = [point_key(p) for p in expand(SweepSpec.from_dict(spec))]
    out = tmp_path / "out"
    out.mkdir()
    (out / "again.jsonl").write_text(
        json.dumps({"key": keys[0], "started_at": "2026-11-29T17:46:08+00:00"}) + "\n"
        + json.dumps({"key": keys[1], "started_at": "2026-11-29T18:50:00+00:00"}) + "\n")
    assert done_keys(out / "again.jsonl") == set(keys)
    assert done_keys(out / "again.jsonl", since="2026-11-29T18:40") == {keys[1]}

    def dry(*extra):
        return subprocess.run([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--dry-run",
                               "--out-dir", str(out), *extra], cwd=REPO, env=child_env(), capture_output=True,
                              text=True, timeout=120)

    assert keys[0] not in dry().stdout
    listed = dry("--since", "2026-11-29T18:40").stdout
    assert keys[0] in listed and keys[1] not in listed
    bad = dry("--since", "yesterday")
    assert bad.returncode == 1 and "--since 'yesterday' is not an ISO time" in bad.stderr


def test_base_only_points_send_every_request_to_the_base_model():
    from bench.workload import TraceRequest

    spec = SweepSpec.from_dict({"name": "x", "setting": "S2", "systems": ["loraplex", "base-only"], "n": [5],
                                "rates": [40]})
    lora, base_only = expand(spec)
    by_adapter = lambda r: "base" if r.adapter is None else f"a{r.adapter}"  # noqa: E731
    requests = [TraceRequest(0, 0.0, None, 8, 8), TraceRequest(1, 0.1, 3, 8, 8)]
    assert [point_model_for(lora, "base", by_adapter)(r) for r in requests] == ["base", "a3"]
    assert [point_model_for(base_only, "base", by_adapter)(r) for r in requests] == ["base", "base"]


def test_a_sweep_spread_over_two_gpus_runs_each_point_once_in_its_own_lane(tmp_path):
    # Two drivers side by side (on the CPU here), each its share of the points, its own stack, registry and
    # blobs; their lines land in one results file; running again finds nothing left.
    spec = {**TWO_POINTS, "systems": ["loraplex"], "by_system": {}}
    spec_path = tmp_path / "tiny-two.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    work, out = tmp_path / "work", tmp_path / "out"

    def on_gpus(budget):
        return subprocess.run([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--gpus", "2",
                               "--budget-s", str(budget), "--work-dir", str(work), "--out-dir", str(out), "--quiet"],
                              cwd=REPO, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)

    first = on_gpus(200)
    assert first.returncode == 0, first.stdout + first.stderr
    lines = results(out)
    assert sorted((x["n_adapters"], x["lane"]) for x in lines) == [(2, "gpu0"), (3, "gpu1")]
    assert lines[0]["run"] == lines[1]["run"]  # the lanes carry their parent's run
    assert all(x["n_completed"] > 0 for x in lines)
    assert "[gpu0]" in first.stderr and "[gpu1]" in first.stderr
    # Each lane counts the sweep's points, then its own share.
    assert "[gpu1] sweep tiny-two: 0 of 2 points done, 2 to run, 1 of them in this lane's share (1/2)" in first.stderr
    assert "2 of 2 points" in first.stdout
    data = sorted(d.name for d in (work / "data").iterdir())
    assert data == ["tiny-s0-gpu0", "tiny-s0-gpu1"], data  # a registry and blobs per lane
    assert json.loads((work / "timings.json").read_text())["startup"]  # both lanes merged their timings

    again = on_gpus(200)
    assert again.returncode == 0 and len(results(out)) == 2, again.stdout + again.stderr


def test_lanes_stopped_by_sigterm_stop_their_stacks(tmp_path):
    import signal
    import time

    from shared.probes import alive, descendants

    spec_path = tmp_path / "tiny-two.yaml"
    # Points far longer than the wait for both lanes' stacks (up to 150 s), so neither can end before the signal
    # (with 60 s points, a lane ready a minute before the other once wrote its line).
    spec_path.write_text(yaml.safe_dump({**TWO_POINTS, "systems": ["loraplex"], "by_system": {}, "duration_s": 300}))
    parent = subprocess.Popen([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--gpus", "2",
                               "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out"), "--quiet"],
                              cwd=REPO, env=child_env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    logs_dir = tmp_path / "work" / "logs"
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # both lanes' stacks up
            seen.update(descendants(parent.pid))
            ready = [f for f in logs_dir.glob("*.log")] if logs_dir.is_dir() else []
            if len([f for f in ready if "loraplex.ready" in f.read_text(errors="replace")]) == 2:
                break
            assert parent.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        seen.update(descendants(parent.pid))
        assert len(seen) >= 12  # two drivers, each with a launcher, redis, store, scheduler, worker, gateway
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(90) == 128 + signal.SIGTERM
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 15
    while [p for p in seen if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in seen if alive(p)] == []
    assert not (tmp_path / "out" / "tiny-two.jsonl").exists()


def test_shares_of_the_remaining_points_are_disjoint_and_cover_them(tmp_path):
    from bench.driver import shard_of

    spec = SweepSpec.from_dict({**TWO_POINTS, "n": [1, 2, 3, 4, 5]})
    pending = groups(expand(spec))
    shares = [Driver(spec, tmp_path, tmp_path / "r.jsonl", shard=(i, 3)).my_share(pending) for i in range(3)]
    keys = [point_key(p) for share in shares for _, group in share for p in group]
    assert sorted(keys) == sorted(point_key(p) for _, g in pending for p in g) and len(set(keys)) == len(keys)
    assert all(share for share in shares)
    assert shard_of("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError, match="shard"):
            shard_of(bad)


def test_gpus_are_a_count_or_a_list_of_ids():
    from bench.cli import gpus_of

    assert gpus_of("4") == [0, 1, 2, 3] and gpus_of("2,3") == [2, 3] and gpus_of("1") == [0]
    for bad in ("x", "0", "1,1", "-1,2"):
        with pytest.raises(ValueError, match="--gpus"):
            gpus_of(bad)


def test_only_runs_the_points_whose_key_matches_and_lanes_pass_it_on(tmp_path):
    from bench.driver import selected
    from bench.lanes import lane_argv

    spec = {"name": "some", "setting": "S2", "systems": ["loraplex", "base-only"], "n": [2000, 100, 5],
            "by_system": {"base-only": {"n": [100]}}, "rates": [40]}
    spec_path = tmp_path / "some.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    points = expand(SweepSpec.from_dict(spec))
    picked = [point_key(p) for p in selected(points, ("/n=5/", "base-only"))]
    assert picked == ["S2/base-only/n=100/alpha=1/R=40/cv=1/early-abort/d=120/seed=0",
                      "S2/loraplex/n=5/alpha=1/R=40/cv=1/early-abort/d=120/seed=0"]
    assert len(selected(points, ())) == len(points) == 4

    listed = subprocess.run([sys.executable, "-m", "shared.cli", "bench", "sweep", str(spec_path), "--dry-run",
                             "--out-dir", str(tmp_path), "--only", "/n=100/"], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=120).stdout
    assert "S2/loraplex/n=100/" in listed and "S2/base-only/n=100/" in listed
    assert "n=2000" not in listed and "n=5/" not in listed
    argv = lane_argv(str(spec_path), 1, 0, 2, 500, tmp_path, str(tmp_path), "", True, ("/n=5/", "base-only"))
    assert argv[argv.index("--only"):argv.index("--only") + 4] == ["--only", "/n=5/", "--only", "base-only"]
    assert "--run" not in argv
    run = lane_argv(str(spec_path), 1, 0, 2, 500, tmp_path, str(tmp_path), "", True, (), "2026-12-02T15:00:00+00:00")
    assert run[run.index("--run") + 1] == "2026-12-02T15:00:00+00:00"


def test_a_points_summary_gives_the_held_roofline_fraction_where_its_line_has_one():
    from bench.driver import summary

    line = {"setting": "S-GQA", "system": "loraplex", "n_adapters": 5, "req_rate": 60.0, "cv": 1.0,
            "policy": "early-abort", "throughput_rps": 45.61, "ttft_p50_s": 1.3, "slo_attainment": 0.81,
            "roofline_fraction": 0.556}
    assert summary(line).endswith("roofline 0.56")
    assert summary({**line, "roofline_fraction_held": 0.597}).endswith(
        "roofline 0.56 (0.60 at the held matmul rate)")
