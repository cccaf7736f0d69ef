"""The serving targets read off result lines: measured values, the rooflines' bound, verdicts."""
import json
import subprocess
import sys

from bench import REPO, child_env
from bench.targets import saturation_points, table, verdicts


def line(system, n, rps, roof, setting="S2", rate=40.0, cv=1.0, started="2026-12-01T19:00:00+00:00", **more):
    return {"setting": setting, "system": system, "n_adapters": n, "alpha": 1.0, "req_rate": rate, "cv": cv,
            "policy": "early-abort", "duration_s": 140.0, "throughput_rps": rps, "roofline_rps": roof,
            "roofline_fraction": rps / roof, "started_at": started, **more}


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_each_target_gets_its_measurement_bound_and_verdict(tmp_path):
    sat = write(tmp_path / "s2-saturation.jsonl", [
        line("loraplex", 2000, 24.6, 39.8), line("loraplex", 5, 28.3, 46.5), line("loraplex", 100, 27.9, 43.9),
        line("base-only", 100, 33.3, 46.6),
        line("loraplex", 100, 20.0, 43.9, cv=4.0),  # a burstiness point is not a saturation point
        line("loraplex", 100, 12.0, 43.9, rate=12.0),  # nor one below the highest rate
    ])
    base = write(tmp_path / "s2-baselines.jsonl", [line("peft", 100, 0.17, 43.9, started="2026-11-29T22:40:00+00:00")])
    v = {x.target: x for x in verdicts([sat, base])}
    assert v["S2 n = 2000 ≥ 30 req/s"].status == "missed: 0.82 of it"
    assert "needs 0.75 of its roofline" in v["S2 n = 2000 ≥ 30 req/s"].bound
    # 24.6 / 28.3 = 0.87 < 0.9 and the rooflines allow only 39.8 / 46.5 = 0.856: no faster server meets it.
    far = v["S2 n = 2000 ≥ 0.9 × n = 5"]
    assert far.status == "missed, beyond the roofline" and "0.856" in far.bound and "0.87×" in far.measured
    near = v["S2 n = 100 ≥ 0.9 × base-only n = 100"]
    assert near.status == "missed" and "0.942" in near.bound and "0.84×" in near.measured
    peft = v["S2 n = 100 ≥ 30 × peft n = 100"]
    # The target asks for both points from one run; these lines carry no run in common.
    assert peft.status == "met, but not from one run" and peft.bound == "" and "2026-11-29" in peft.measured
    fractions = v["≥ 60% of the roofline"]
    assert fractions.status == "met at every point"  # loraplex's three points, 0.61-0.64
    assert fractions.measured == "S2 n = 5 0.61; S2 n = 100 0.64; S2 n = 2000 0.62"


def test_the_latest_line_of_a_point_wins_and_missing_points_say_so(tmp_path):
    old = line("loraplex", 2000, 17.9, 39.8, started="2026-11-29T22:30:00+00:00")
    new = line("loraplex", 2000, 31.0, 39.8, started="2026-12-01T19:50:00+00:00")
    a = write(tmp_path / "a.jsonl", [new])
    b = write(tmp_path / "b.jsonl", [old])
    assert saturation_points([a, b])[("S2", "loraplex", 2000)]["throughput_rps"] == 31.0
    v = {x.target: x for x in verdicts([a, b])}
    assert v["S2 n = 2000 ≥ 30 req/s"].status == "met"
    assert v["≥ 60% of the roofline"].status == "met at every point"
    low = write(tmp_path / "c.jsonl", [line("loraplex", 5, 20.0, 46.5, setting="S-GQA")])
    assert {x.target: x for x in verdicts([a, low])}["≥ 60% of the roofline"].status == (
        "met at S2 n = 2000; missed at S-GQA n = 5 (0.72 of it); S-GQA n = 5: its line (2026-12-01) carries no step "
        "floors")
    assert v["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == "not measured"


def test_targets_command_prints_the_table(tmp_path):
    path = write(tmp_path / "s2.jsonl", [line("loraplex", 2000, 24.6, 39.8), line("loraplex", 5, 28.3, 46.5)])
    out = subprocess.run([sys.executable, "-m", "shared.cli", "bench", "targets", path], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == table([path])
    assert out.stdout.splitlines()[0] == "| target | measured | what the rooflines allow | status |"
    assert "| S2 n = 2000 ≥ 0.9 × n = 5 | 24.6 / 28.30 = 0.87×" in out.stdout


def test_a_missed_ratio_says_where_the_time_goes_when_both_points_recorded_it(tmp_path):
    def steps(graph_ms, prefill_ms, prefill_share):
        return {"graph": {"steps": 5000, "mean_ms": graph_ms, "share": 1 - prefill_share},
                "decode": {"steps": 0, "mean_ms": None, "share": 0.0},
                "prefill": {"steps": 250, "mean_ms": prefill_ms, "share": prefill_share}}

    sat = write(tmp_path / "s2-saturation.jsonl", [
        line("loraplex", 100, 28.2, 42.9, worker_steps=steps(21.8, 212.7, 0.31)),
        line("base-only", 100, 32.9, 45.4, worker_steps=steps(17.8, 187.9, 0.30)),
        line("loraplex", 5, 29.9, 45.1), line("loraplex", 2000, 24.6, 39.8)])  # no steps recorded: no account
    v = {x.target: x for x in verdicts([sat])}
    assert v["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == (
        "missed; decode (graph) steps 21.8 vs 17.8 ms (69% vs 70% of step time), "
        "prefill steps 212.7 vs 187.9 ms (31% vs 30% of step time)")
    assert v["S2 n = 2000 ≥ 0.9 × n = 5"].status == "missed, beyond the roofline"
    # Lines that recorded the host's part of each step say it too.
    def base_only_ratio(name, lora_steps, base_steps):
        sat = write(tmp_path / f"{name}.jsonl", [line("loraplex", 100, 28.2, 42.9, worker_steps=lora_steps),
                                                 line("base-only", 100, 32.9, 45.4, worker_steps=base_steps)])
        return {x.target: x for x in verdicts([sat])}["S2 n = 100 ≥ 0.9 × base-only n = 100"].status

    timed = steps(21.8, 212.7, 0.31)
    timed["prefill"]["launch_ms"], timed["graph"]["launch_ms"] = 120.5, 1.2
    base = steps(17.8, 187.9, 0.30)
    base["prefill"]["launch_ms"], base["graph"]["launch_ms"] = 60.25, 1.0
    assert base_only_ratio("timed", timed, base) == (
        "missed; decode (graph) steps 21.8 vs 17.8 ms (69% vs 70% of step time; launched by the host in 1.2 vs "
        "1.0 ms), prefill steps 212.7 vs 187.9 ms (31% vs 30% of step time; launched by the host in 120.5 vs "
        "60.2 ms)")
    # And those that recorded each kind's floor, how near their steps ran to it.
    floored, floored_base = steps(21.8, 212.7, 0.31), steps(17.8, 187.9, 0.30)
    floored["graph"].update(floor_ms=16.35, of_floor=0.75)
    floored_base["graph"].update(floor_ms=15.13, of_floor=0.85)
    assert base_only_ratio("floors", floored, floored_base) == (
        "missed; decode (graph) steps 21.8 vs 17.8 ms (69% vs 70% of step time; floors 16.4 vs 15.1 ms, the steps "
        "at 0.75 vs 0.85 of them), prefill steps 212.7 vs 187.9 ms (31% vs 30% of step time)")
    # And those that recorded the adapters a step read, how many and how many bytes of rows.
    timed["graph"].update(adapters_mean=333.4, adapter_mb_mean=21012.5)
    timed["prefill"].update(adapters_mean=340.0, adapter_mb_mean=21400.0)
    base["graph"].update(adapters_mean=0.0, adapter_mb_mean=0.0)
    base["prefill"].update(adapters_mean=0.0, adapter_mb_mean=0.0)
    assert base_only_ratio("rows", timed, base) == (
        "missed; decode (graph) steps 21.8 vs 17.8 ms (69% vs 70% of step time; launched by the host in 1.2 vs "
        "1.0 ms; rows of 333 vs 0 adapters read, 21.01 vs 0.00 GB a step), prefill steps 212.7 vs 187.9 ms "
        "(31% vs 30% of step time; launched by the host in 120.5 vs 60.2 ms; rows of 340 vs 0 adapters read, "
        "21.40 vs 0.00 GB a step)")
    # And those that counted the tokens their steps ran, how many a mean step ran.
    counted, counted_base = steps(21.8, 212.7, 0.31), steps(17.8, 187.9, 0.30)
    counted["graph"]["tokens"], counted_base["graph"]["tokens"] = 5000 * 227.4, 5000 * 256.0
    counted["prefill"]["tokens"] = 250 * 861.2  # the other point did not count them: nothing said
    assert base_only_ratio("tokens", counted, counted_base) == (
        "missed; decode (graph) steps 21.8 vs 17.8 ms (69% vs 70% of step time; 227 vs 256 tokens a step), "
        "prefill steps 212.7 vs 187.9 ms (31% vs 30% of step time)")


def test_a_same_run_target_is_met_only_by_two_lines_of_one_run(tmp_path):
    run = "2026-12-02T15:00:00+00:00"
    lines = [line("loraplex", 100, 28.2, 43.9, run=run), line("peft", 100, 0.24, 43.9, run=run)]
    peft = {x.target: x for x in verdicts([write(tmp_path / "a.jsonl", lines)])}["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.status == "met" and "(one run, 2026-12-01)" in peft.measured
    lines[1] = line("peft", 100, 0.24, 43.9, run="2026-12-02T16:00:00+00:00")
    peft = {x.target: x for x in verdicts([write(tmp_path / "b.jsonl", lines)])}["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.status == "met, but not from one run" and "one run" not in peft.measured
    # A ratio of two runs that also misses says both.
    lines[0] = line("loraplex", 100, 5.0, 43.9, run=run)
    peft = {x.target: x for x in verdicts([write(tmp_path / "c.jsonl", lines)])}["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.status == "missed, but not from one run"


def test_a_same_run_target_takes_the_latest_run_of_both_sides_over_later_lines_of_two(tmp_path):
    early, late, alone = "2026-12-02T17:03:00+00:00", "2026-12-02T18:00:00+00:00", "2026-12-05T10:00:00+00:00"

    def runs(peft_late_rps):
        # one file per sweep, as docs/bench keeps them (a file's later line of a point replaces its earlier)
        return [write(tmp_path / "early.jsonl", [line("loraplex", 100, 27.9, 43.9, run=early, started=early),
                                                 line("peft", 100, 0.3, 43.9, run=early, started=early)]),
                write(tmp_path / "late.jsonl", [line("loraplex", 100, 26.0, 43.9, run=late, started=late),
                                                line("peft", 100, peft_late_rps, 43.9, run=late, started=late)]),
                # measured again alone afterwards: the latest line of its side, of no run with peft
                write(tmp_path / "alone.jsonl", [line("loraplex", 100, 32.9, 46.9, run=alone, started=alone)])]

    peft = {x.target: x for x in verdicts(runs(0.5))}["S2 n = 100 ≥ 30 × peft n = 100"]
    # The later of the two runs that measured both sides: 26.0 / 0.5 = 52×, not the earlier run's 93×.
    assert peft.measured == "26.0 / 0.50 = 52.00× (one run, 2026-12-02)"
    assert peft.status == "met; the latest lines, of two runs: 32.9 / 0.50 = 65.80× (2026-12-05, 2026-12-02)"
    # A ratio below the target in its one run is missed, whatever the later lines of two runs give.
    peft = {x.target: x for x in verdicts(runs(1.0))}["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.measured.startswith("26.0 / 1.00 = 26.00× (one run") and peft.status.startswith("missed; the latest")


def test_a_point_on_a_pool_the_sweep_sized_is_not_a_saturation_point(tmp_path):
    whole = line("loraplex", 100, 27.9, 43.9, started="2026-12-02T17:13:00+00:00")
    sized = line("loraplex", 100, 20.0, 43.9, started="2026-12-02T17:22:00+00:00", num_slots=108000)
    path = write(tmp_path / "s2.jsonl", [whole])
    memory = write(tmp_path / "s2-memory.jsonl", [sized])
    # The later line is on a smaller pool: the whole GPU's line stays the point.
    assert saturation_points([path, memory])[("S2", "loraplex", 100)]["throughput_rps"] == 27.9
    assert ("S2", "loraplex", 100) not in saturation_points([memory])


def test_a_ratio_of_two_running_batches_is_not_compared(tmp_path):
    path = write(tmp_path / "s2.jsonl", [
        line("loraplex", 2000, 27.3, 42.3, roofline_batch=384), line("loraplex", 5, 29.9, 45.1, roofline_batch=256),
        line("loraplex", 100, 31.3, 46.9, roofline_batch=384), line("base-only", 100, 32.3, 48.7, roofline_batch=384),
        line("peft", 100, 0.3, 46.9, roofline_batch=256),
    ])
    v = {x.target: x for x in verdicts([path])}
    far = v["S2 n = 2000 ≥ 0.9 × n = 5"]
    assert far.status == "not comparable: running batches 384 and 256 (measure both at one)"
    assert "0.91×" in far.measured
    assert v["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == "met"  # both at 384
    assert v["S2 n = 100 ≥ 30 × peft n = 100"].status.startswith("met")  # a baseline's batch is its own


def test_a_line_that_tried_a_server_setting_does_not_count_for_the_targets(tmp_path):
    shipped = "python3 -m shared.cli up --set worker.max_running_requests=384"
    held = shipped + " --set worker.admission_wait_s=0.5"
    path = write(tmp_path / "s2.jsonl", [
        line("loraplex", 2000, 27.3, 42.3, stack_command=shipped),
        line("loraplex", 2000, 23.3, 42.3, stack_command=held, started="2026-12-03T08:30:00+00:00"),
    ])
    assert saturation_points([path])[("S2", "loraplex", 2000)]["throughput_rps"] == 27.3
    assert {x.target: x for x in verdicts([path])}["S2 n = 2000 ≥ 30 req/s"].measured.startswith("27.3 req/s")


def test_a_ratio_of_points_served_by_different_code_says_so(tmp_path):
    sat = tmp_path / "s2-saturation.jsonl"
    write(sat, [line("loraplex", 2000, 28.5, 41.1, server_code="aaaaaaaaaaaa"),
                line("loraplex", 5, 30.1, 48.2, server_code="bbbbbbbbbbbb"),
                line("loraplex", 100, 31.3, 47.0, server_code="aaaaaaaaaaaa"),
                line("base-only", 100, 32.3, 48.9, server_code="aaaaaaaaaaaa")])
    v = {x.target: x for x in verdicts([str(sat)])}
    assert v["S2 n = 2000 ≥ 0.9 × n = 5"].status == "met, but served by different code (aaaaaaaaaaaa, bbbbbbbbbbbb)"
    # Same code, or a line from before lines carried it: nothing to say.
    assert v["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == "met"
    write(sat, [line("loraplex", 2000, 28.5, 41.1, server_code="aaaaaaaaaaaa"), line("loraplex", 5, 30.1, 48.2)])
    assert {x.target: x for x in verdicts([str(sat)])}["S2 n = 2000 ≥ 0.9 × n = 5"].status == "met"


def test_a_missed_target_names_how_busy_the_gpu_was(tmp_path):
    sat = tmp_path / "s2-saturation.jsonl"
    write(sat, [line("loraplex", 2000, 24.0, 41.1, gpu_busy_mean=0.93), line("loraplex", 5, 30.0, 48.2, gpu_busy_mean=0.99),
                line("loraplex", 100, 31.3, 47.0, gpu_busy_mean=0.97), line("base-only", 100, 32.3, 48.9)])
    v = {x.target: x for x in verdicts([str(sat)])}
    assert v["S2 n = 2000 ≥ 30 req/s"].status == "missed: 0.80 of it; GPU busy 93% of the point"
    assert v["S2 n = 2000 ≥ 0.9 × n = 5"].status.endswith("; GPU busy 93% vs 99%")
    # Met, or one line without the figure: nothing to add.
    assert v["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == "met"
    # A line that carries its measured window's share is judged by it, not by the whole run's.
    write(sat, [line("loraplex", 2000, 24.0, 41.1, gpu_busy_mean=0.88, gpu_busy_window_mean=0.96),
                line("loraplex", 5, 30.0, 48.2, gpu_busy_mean=0.99)])
    v = {x.target: x for x in verdicts([str(sat)])}
    assert v["S2 n = 2000 ≥ 30 req/s"].status == "missed: 0.80 of it; GPU busy 96% of the point"
    assert v["S2 n = 2000 ≥ 0.9 × n = 5"].status.endswith("; GPU busy 96% vs 99%")


def test_lines_that_record_the_attainable_throughput_say_how_much_of_the_roofline_it_allows(tmp_path):
    sat = write(tmp_path / "s2-batch384.jsonl", [
        line("loraplex", 2000, 28.5, 41.2, roofline_batch=384, attainable_rps=37.5),
        line("loraplex", 5, 33.8, 48.2, roofline_batch=384),  # an older line without it
        line("loraplex", 100, 20.0, 80.0, setting="S-GQA", rate=60.0, roofline_batch=512, attainable_rps=64.0)])
    v = {x.target: x for x in verdicts([sat])}
    assert v["S2 n = 2000 ≥ 30 req/s"].bound == (
        "needs 0.73 of its roofline (41.2 req/s); every operation at its binding ceiling: 37.5 req/s (0.91 of it)")
    assert v["≥ 60% of the roofline"].measured == "S-GQA n = 100 0.25 (at most 0.80); S2 n = 5 0.70; S2 n = 2000 0.69 (at most 0.91)"


def test_a_line_with_the_held_roofline_shows_its_fraction_beside_the_one_judged(tmp_path):
    sat = write(tmp_path / "sgqa.jsonl", [
        line("loraplex", 5, 45.6, 81.7, setting="S-GQA", rate=60.0, roofline_batch=512, attainable_rps=68.1,
             roofline_rps_held=76.4, roofline_fraction_held=45.6 / 76.4)])
    v = {x.target: x for x in verdicts([sat])}["≥ 60% of the roofline"]
    assert v.measured == "S-GQA n = 5 0.56 (at most 0.83) [0.60 at the held matmul rate]"
    assert v.status.startswith("missed at every point")  # judged by the burst's roofline, not the held one


def test_a_line_measured_on_another_gpu_neither_stands_for_the_target_gpu_nor_enters_a_ratio(tmp_path):
    h200 = dict(gpu="NVIDIA H200")
    path = write(tmp_path / "s2.jsonl", [
        line("loraplex", 100, 32.9, 47.0, started="2026-12-03T10:00:00+00:00", **h200),
        line("base-only", 100, 33.3, 46.6, **h200),
        # Later, so it would win its point if GPUs were not told apart.
        line("loraplex", 100, 21.7, 33.6, started="2026-12-05T13:49:00+00:00", gpu="NVIDIA H100 80GB HBM3"),
    ])
    assert saturation_points([path])[("S2", "loraplex", 100)]["throughput_rps"] == 32.9
    assert "32.9 / 33.30" in {x.target: x for x in verdicts([path])}["S2 n = 100 ≥ 0.9 × base-only n = 100"].measured
    on_h100 = {x.target: x for x in verdicts([path], gpu="H100")}
    assert on_h100["S2 n = 100 ≥ 0.9 × base-only n = 100"].status == "not measured"
    out = subprocess.run([sys.executable, "-m", "shared.cli", "bench", "targets", "--gpu", "H100", path], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "S2 n = 100 0.65" in out.stdout and "S2 n = 100 0.70" not in out.stdout


def test_a_missed_point_says_where_its_worker_time_went_against_its_steps_floors(tmp_path):
    def steps(graph_share, graph_of, prefill_of, captures=0):
        return {"graph": {"steps": 3000, "mean_ms": 35.8, "share": graph_share, "floor_ms": 27.8, "of_floor": graph_of,
                          "captures": captures, "capture_s": 0.9 * captures, "gpu_ms": 31.2 if captures else None},
                "decode": {"steps": 0, "mean_ms": None, "share": 0.0},
                "prefill": {"steps": 280, "mean_ms": 131.1, "share": 1 - graph_share, "floor_ms": 96.0,
                            "of_floor": prefill_of, "gpu_ms": 140.0 if captures else None,
                            "builds": 2 if captures else 0, "build_s": 0.7 if captures else 0.0}}

    path = write(tmp_path / "s2.jsonl", [
        line("loraplex", 2000, 29.0, 42.3, worker_steps=steps(0.75, 0.8, 0.6)),
        line("loraplex", 5, 34.2, 48.3, worker_steps=steps(0.75, 0.9, 0.9)),  # met: nothing to add
        line("loraplex", 100, 20.0, 80.0, setting="S-GQA", rate=60.0, worker_steps=steps(0.5, 0.5, 0.75, captures=3)),
        line("loraplex", 5, 40.0, 80.0, setting="S-GQA", rate=60.0),  # missed, but a line without floors
    ])
    v = {x.target: x for x in verdicts([path])}
    # At their floors the steps take 0.75 * 0.8 + 0.25 * 0.6 = 0.75 of their time: 29.0 / 0.75 = 38.7 req/s.
    assert v["S2 n = 2000 ≥ 30 req/s"].status == (
        "missed: 0.97 of it; decode (graph) steps 35.8 ms (75% of step time) at 0.80 of their 27.8 ms floor, "
        "prefill steps 131.1 ms (25% of step time) at 0.60 of their 96.0 ms floor; the same steps at their floors: "
        "38.7 req/s")
    status = v["≥ 60% of the roofline"].status
    # S-GQA n = 100: 0.5 * 0.5 + 0.5 * 0.75 = 0.625 of its step time, 20.0 / 0.625 = 32.0 req/s.
    # Its graph steps captured three graphs under load and its prefill steps built two kernels: said beside them
    # (S2's captured and built none: nothing said).
    # Its prefill steps' GPU intervals outlast their wall time (launched ahead, issued slowly): the stream's idle
    # share comes from every kind together, 1 - (3000 * 31.2 + 280 * 140.0) / (3000 * 35.8 + 280 * 131.1) = 8%.
    assert status.endswith("; S-GQA n = 100: decode (graph) steps 35.8 ms (50% of step time) at 0.50 of their "
                           "27.8 ms floor, the GPU running 31.2 ms of each (3 graphs captured under load in them, "
                           "2.7 s), prefill steps 131.1 ms (50% of step time) at 0.75 of their 96.0 ms floor, the "
                           "GPU running 140.0 ms of each (2 kernels built under load in them, 0.7 s); the stream idle 8% "
                           "of step time; the same steps at their floors: 32.0 req/s")
    # Each point under the target is named with how far below it is (0.50 / 0.60, 0.25 / 0.60), and one whose
    # line carries no floors says so instead of being left out.
    assert status.startswith("met at S2 n = 5, S2 n = 2000; missed at S-GQA n = 5 (0.83 of it), "
                             "S-GQA n = 100 (0.42 of it); S-GQA n = 5: its line (2026-12-01) carries no step floors; "
                             "S-GQA n = 100: ")
    assert "S2 n = 5:" not in status and "S2 n = 2000:" not in status


def test_the_steps_of_a_lines_window_stand_for_its_steps_where_it_has_them(tmp_path):
    # The window's steady batch runs longer steps than the whole run's, whose ramp and drain make short ones.
    whole = {"graph": {"steps": 3200, "mean_ms": 34.1, "share": 0.75, "floor_ms": 27.8, "of_floor": 0.82},
             "prefill": {"steps": 430, "mean_ms": 97.0, "share": 0.25, "floor_ms": 71.2, "of_floor": 0.73}}
    window = {"graph": {"steps": 2800, "mean_ms": 36.0, "share": 0.8, "floor_ms": 29.0, "of_floor": 0.8},
              "prefill": {"steps": 380, "mean_ms": 99.0, "share": 0.2, "floor_ms": 74.0, "of_floor": 0.75}}
    path = write(tmp_path / "s2.jsonl", [line("loraplex", 2000, 29.0, 42.3, worker_steps=whole,
                                              worker_steps_window=window)])
    status = {x.target: x for x in verdicts([path])}["S2 n = 2000 ≥ 30 req/s"].status
    # At their floors: 0.8 * 0.8 + 0.2 * 0.75 = 0.79 of the window's step time, 29.0 / 0.79 = 36.7 req/s.
    assert status == ("missed: 0.97 of it; decode (graph) steps 36.0 ms (80% of step time) at 0.80 of their 29.0 ms "
                      "floor, prefill steps 99.0 ms (20% of step time) at 0.75 of their 74.0 ms floor; the same steps "
                      "at their floors: 36.7 req/s")
