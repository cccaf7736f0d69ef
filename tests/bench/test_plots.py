"""Figures from result lines: each figure's lines are the series the file's points support."""
import json

import pytest

from bench.plots import plot_file, read_lines

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def line(system="loraplex", n=100, rate=20.0, cv=1.0, policy="early-abort", setting="S2", **figures):
    out = {"setting": setting, "system": system, "n_adapters": n, "alpha": 1.0, "req_rate": rate, "cv": cv,
           "policy": policy, "duration_s": 120.0, "throughput_rps": 1.0, "slo_attainment": 1.0,
           "user_satisfaction": 0.9}
    out.update(figures)
    return out


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_throughput_vs_adapters_has_a_line_per_system(tmp_path):
    lines = [line("loraplex", n, throughput_rps=10.0 - n / 1000) for n in (5, 100, 1000)]
    lines += [line("bmm", n, throughput_rps=5.0 / (1 + n / 100)) for n in (5, 100)]
    lines += [line("peft", 5, throughput_rps=0.8)]  # one point: drawn as a point beside the lines
    lines += [line("loraplex", 100, throughput_rps=9.5)]  # a rerun replaces the earlier measurement
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines), tmp_path / "png")
    png = str(tmp_path / "png" / "sat-throughput-vs-adapters-S2.png")
    assert list(drawn) == [png]
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert drawn[png]["throughput_rps"] == {
        "bmm": [(5.0, pytest.approx(5 / 1.05)), (100.0, 2.5)],
        "loraplex": [(5.0, 9.995), (100.0, 9.5), (1000.0, 9.0)],
        "peft": [(5.0, 0.8)],
    }
    # Single points alone make no figure.
    assert plot_file(write(tmp_path / "one.jsonl", [line("peft", 5, throughput_rps=0.8),
                                                     line("base-only", 100, throughput_rps=20.0)]),
                     tmp_path / "png") == {}


def test_rate_sweep_draws_throughput_and_slo_attainment(tmp_path):
    lines = [line(rate=r, n=200, throughput_rps=min(r, 12.0), slo_attainment=1.0 if r <= 12 else 0.5)
             for r in (4.0, 8.0, 12.0, 16.0)]
    drawn = plot_file(write(tmp_path / "rate.jsonl", lines))
    png = str(tmp_path / "rate-rate-S2.png")
    assert list(drawn) == [png] and open(png, "rb").read(8) == PNG_MAGIC
    assert drawn[png]["throughput_rps"] == {"loraplex": [(4.0, 4.0), (8.0, 8.0), (12.0, 12.0), (16.0, 12.0)]}
    assert drawn[png]["slo_attainment"] == {"loraplex": [(4.0, 1.0), (8.0, 1.0), (12.0, 1.0), (16.0, 0.5)]}
    # With the rate the client sent, served is drawn against offered.
    sent = [{**x, "offered_rps": x["req_rate"] * 1.01} for x in lines]
    drawn = plot_file(write(tmp_path / "rate.jsonl", sent))
    assert drawn[png]["throughput_rps"]["offered"] == [(r, pytest.approx(r * 1.01)) for r in (4.0, 8.0, 12.0, 16.0)]
    assert "offered" not in drawn[png]["slo_attainment"]


def test_cv_sweep_draws_a_line_per_policy(tmp_path):
    lines = []
    for policy, base in (("early-abort", 0.8), ("fcfs", 0.3), ("lcfs", 0.5)):
        lines += [line(policy=policy, cv=cv, rate=16.0, slo_attainment=base / cv, user_satisfaction=base / cv / 2)
                  for cv in (1.0, 2.0, 4.0, 8.0)]
    drawn = plot_file(write(tmp_path / "cv.jsonl", lines))
    png = str(tmp_path / "cv-cv-S2.png")
    assert list(drawn) == [png] and open(png, "rb").read(8) == PNG_MAGIC
    assert set(drawn[png]["slo_attainment"]) == {"early-abort", "fcfs", "lcfs"}
    assert drawn[png]["slo_attainment"]["fcfs"] == [(1.0, 0.3), (2.0, 0.15), (4.0, 0.075), (8.0, 0.0375)]
    assert drawn[png]["user_satisfaction"]["early-abort"][0] == (1.0, 0.4)
    # A policy measured at one cv so far shows as a point; a file of such points alone draws no figure.
    one = line(policy="early-abort-deadline", cv=4.0, rate=16.0, slo_attainment=1.0, user_satisfaction=0.95)
    drawn = plot_file(write(tmp_path / "cv.jsonl", lines + [one]))
    assert drawn[png]["slo_attainment"]["early-abort-deadline"] == [(4.0, 1.0)]
    assert not plot_file(write(tmp_path / "lone.jsonl", [one]))


def test_bad_lines_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(line()) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_lines(bad)
    bad.write_text(json.dumps({"setting": "S2"}) + "\n")
    with pytest.raises(ValueError, match="lacks system"):
        read_lines(bad)


def test_settings_side_by_side_over_several_files(tmp_path):
    from bench.plots import plot_all

    s1 = [line(n=n, setting="S1", rate=40.0, throughput_rps=26.0 - n / 1000, roofline_fraction=0.6) for n in (5, 100, 2000)]
    s2 = [line(n=n, setting="S2", rate=40.0, throughput_rps=27.0 - n / 500, roofline_fraction=0.5) for n in (5, 2000)]
    s2 += [line("base-only", 100, setting="S2", rate=40.0, throughput_rps=32.0, roofline_fraction=0.7)]
    rate = [line(n=200, setting="S2", rate=r, throughput_rps=r) for r in (4.0, 8.0)]  # one n: no curve here
    files = [write(tmp_path / "s1.jsonl", s1), write(tmp_path / "s2.jsonl", s2), write(tmp_path / "rate.jsonl", rate)]
    drawn = plot_all(files, tmp_path / "png")
    png = str(tmp_path / "png" / "settings-throughput-vs-adapters.png")
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert drawn[png]["throughput_rps"] == {"S1": [(5.0, 25.995), (100.0, 25.9), (2000.0, 24.0)],
                                           "S2": [(5.0, 26.99), (2000.0, 23.0)]}
    assert drawn[png]["roofline_fraction"] == {"S1": [(5.0, 0.6), (100.0, 0.6), (2000.0, 0.6)],
                                               "S2": [(5.0, 0.5), (2000.0, 0.5)]}
    # One setting alone: its own file's figure says it all.
    assert not any("settings-" in p for p in plot_all(files[:1], tmp_path / "one"))


def test_throughput_vs_adapters_draws_the_rooflines_of_loraplex_and_base_only_dashed(tmp_path):
    lines = [line("loraplex", n, throughput_rps=28.0 - n / 500, roofline_rps=46.0 - n / 300) for n in (5, 100, 2000)]
    lines += [line("base-only", 100, throughput_rps=33.0, roofline_rps=46.6)]
    lines += [line("peft", 100, throughput_rps=0.2, roofline_rps=43.9)]  # a baseline's roofline is loraplex's
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines), tmp_path)
    series = drawn[str(tmp_path / "sat-throughput-vs-adapters-S2.png")]["throughput_rps"]
    assert series["loraplex roofline"] == [(5.0, pytest.approx(46 - 5 / 300)), (100.0, pytest.approx(46 - 1 / 3)),
                                           (2000.0, pytest.approx(46 - 2000 / 300))]
    assert series["base-only roofline"] == [(100.0, 46.6)]
    assert "peft roofline" not in series and series["peft"] == [(100.0, 0.2)]
    assert series["loraplex"][0] == (5.0, 27.99)


def test_throughput_vs_adapters_draws_the_attainable_throughput_where_lines_record_it(tmp_path):
    lines = [line("loraplex", n, throughput_rps=28.0, roofline_rps=46.0, attainable_rps=41.0) for n in (5, 2000)]
    lines += [line("loraplex", 100, throughput_rps=28.0, roofline_rps=46.0)]  # an older line without it
    lines += [line("base-only", 100, throughput_rps=33.0, roofline_rps=46.6, attainable_rps=42.0)]
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines), tmp_path)
    series = drawn[str(tmp_path / "sat-throughput-vs-adapters-S2.png")]["throughput_rps"]
    assert series["loraplex attainable"] == [(5.0, 41.0), (2000.0, 41.0)]
    assert series["base-only attainable"] == [(100.0, 42.0)]
    assert len(series["loraplex roofline"]) == 3


def steps(graph, decode, prefill):
    """worker_steps of a point from (steps, seconds) per kind."""
    total = graph[1] + decode[1] + prefill[1]
    return {kind: {"steps": n, "seconds": s, "tokens": n, "mean_ms": 1e3 * s / n if n else None,
                   "share": s / total}
            for kind, (n, s) in (("graph", graph), ("decode", decode), ("prefill", prefill))}


def test_worker_steps_figure_shows_each_points_shares_and_mean_steps(tmp_path):
    lines = [line("loraplex", 100, rate=40.0, throughput_rps=28.0, worker_steps=steps((5000, 110.0), (0, 0.0), (250, 50.0))),
             line("base-only", 100, rate=40.0, throughput_rps=33.0, worker_steps=steps((6000, 105.0), (10, 0.1), (300, 55.0))),
             line("loraplex", 5, rate=40.0, throughput_rps=30.0)]  # an older line without them: left out
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines))
    png = str(tmp_path / "sat-worker-steps.png")
    assert open(png, "rb").read(8) == PNG_MAGIC
    labels = ["S2 loraplex n=100 R=40 cv=1", "S2 base-only R=40 cv=1"]
    assert drawn[png]["share"]["prefill"] == [(labels[0], pytest.approx(50 / 160)), (labels[1], pytest.approx(55 / 160.1))]
    assert drawn[png]["mean_ms"]["graph"] == [(labels[0], pytest.approx(22.0)), (labels[1], pytest.approx(17.5))]
    # A kind a point never ran is drawn as 0, not left out.
    assert drawn[png]["mean_ms"]["decode"][0] == (labels[0], 0.0)
    # No line with worker steps: no figure.
    assert not any(k.endswith("worker-steps.png") for k in plot_file(write(tmp_path / "old.jsonl", lines[2:]), tmp_path))


def test_worker_steps_figure_draws_the_measured_windows_steps_where_a_line_has_them(tmp_path):
    whole = steps((5000, 110.0), (0, 0.0), (250, 50.0))  # the ramp's and the drain's short steps included
    window = steps((4000, 100.0), (0, 0.0), (200, 44.0))
    lines = [line("loraplex", 2000, rate=40.0, throughput_rps=29.0, worker_steps=whole, worker_steps_window=window),
             line("loraplex", 100, rate=40.0, throughput_rps=31.0, worker_steps=whole)]  # an older line: the run's
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines))
    png = str(tmp_path / "sat-worker-steps.png")
    assert drawn[png]["mean_ms"]["graph"] == [("S2 loraplex n=2000 R=40 cv=1", pytest.approx(25.0)),
                                              ("S2 loraplex n=100 R=40 cv=1", pytest.approx(22.0))]
    assert drawn[png]["share"]["prefill"][0][1] == pytest.approx(44 / 144)


def test_worker_steps_figure_hatches_the_hosts_part_of_each_step_where_lines_record_it(tmp_path):
    timed = steps((5000, 110.0), (0, 0.0), (250, 50.0))
    timed["prefill"]["launch_ms"], timed["graph"]["launch_ms"], timed["decode"]["launch_ms"] = 120.0, 1.5, None
    tried = steps((4000, 100.0), (0, 0.0), (200, 40.0))
    tried["prefill"]["launch_ms"] = 60.0
    held = "up --set worker.max_running_requests=384 --set worker.overlap_steps=true"
    lines = [line(rate=40.0, worker_steps=timed),
             line(rate=40.0, worker_steps=tried, stack_command=held),  # a variant of the same point
             line(n=5, rate=40.0, worker_steps=steps((100, 2.0), (0, 0.0), (10, 1.0)))]  # an older line: no launch
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines))[str(tmp_path / "sat-worker-steps.png")]
    plain, variant = "S2 loraplex n=100 R=40 cv=1", "S2 loraplex n=100 R=40 cv=1 overlap_steps=true"
    assert drawn["launch_ms"] == {"graph": [(plain, 1.5)], "prefill": [(plain, 120.0), (variant, 60.0)]}
    assert [label for label, _ in drawn["mean_ms"]["prefill"]] == [plain, variant, "S2 loraplex n=5 R=40 cv=1"]


def test_worker_steps_figure_gives_the_adapter_rows_a_step_read_where_lines_record_them(tmp_path):
    read = steps((5000, 110.0), (0, 0.0), (250, 50.0))
    for kind, mb in (("graph", 21012.5), ("decode", 0.0), ("prefill", 21400.0)):
        read[kind].update(adapters_mean=333.0 if mb else 0.0, adapter_mb_mean=mb)
    lines = [line(n=2000, rate=40.0, worker_steps=read),
             line(n=5, rate=40.0, worker_steps=steps((100, 2.0), (0, 0.0), (10, 1.0)))]  # an older line: none
    png = str(tmp_path / "sat-worker-steps.png")
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines))[png]
    assert drawn["adapter_gb"]["graph"] == [("S2 loraplex n=2000 R=40 cv=1", pytest.approx(21.0125)),
                                            ("S2 loraplex n=5 R=40 cv=1", 0.0)]
    assert drawn["adapter_gb"]["prefill"][0][1] == pytest.approx(21.4)
    assert open(png, "rb").read(8) == PNG_MAGIC
    # Lines without them: two panels, no third.
    assert "adapter_gb" not in plot_file(write(tmp_path / "old.jsonl", lines[1:]))[str(tmp_path / "old-worker-steps.png")]


def test_worker_steps_figure_marks_each_steps_floor_where_lines_have_one(tmp_path):
    floored = steps((5000, 110.0), (0, 0.0), (250, 50.0))
    floored["graph"].update(floor_ms=15.5, of_floor=0.7)
    lines = [line(n=5, rate=40.0, worker_steps=floored),
             line(n=100, rate=40.0, worker_steps=steps((100, 2.0), (0, 0.0), (10, 1.0)))]  # an older line: none
    png = str(tmp_path / "sat-worker-steps.png")
    drawn = plot_file(write(tmp_path / "sat.jsonl", lines))[png]
    assert drawn["floor_ms"] == {"graph": [("S2 loraplex n=5 R=40 cv=1", 15.5)]}
    assert open(png, "rb").read(8) == PNG_MAGIC


def test_worker_steps_of_a_policy_sweep_name_every_points_policy(tmp_path):
    ws = steps((100, 2.0), (0, 0.0), (10, 1.0))
    lines = [line(policy=p, cv=8.0, rate=24.0, worker_steps=ws) for p in ("early-abort", "fcfs")]
    drawn = plot_file(write(tmp_path / "cv.jsonl", lines))
    labels = [label for label, _ in drawn[str(tmp_path / "cv-worker-steps.png")]["share"]["graph"]]
    assert labels == ["S2 loraplex n=100 R=24 cv=8 early-abort", "S2 loraplex n=100 R=24 cv=8 fcfs"]
    # One policy only: the default goes unnamed, as on every other figure.
    drawn = plot_file(write(tmp_path / "one.jsonl", lines[:1]))
    assert [label for label, _ in drawn[str(tmp_path / "one-worker-steps.png")]["share"]["graph"]] == \
        ["S2 loraplex n=100 R=24 cv=8"]


def test_systems_figure_puts_every_system_on_a_baselines_trace_together_log_scaled(tmp_path):
    from bench.plots import plot_all

    saturation = [line("loraplex", n, rate=40.0, throughput_rps=30.0 - n / 1000) for n in (5, 100, 2000)]
    saturation += [line("base-only", 100, rate=40.0, throughput_rps=33.0)]
    # A server setting tried at one point: its own file's figure shows it, not this one.
    saturation += [line("loraplex", 2000, rate=40.0, throughput_rps=27.0,
                        stack_command="python3 -m shared.cli up --set worker.admission_wait_s=0.5")]
    rate = [line("loraplex", 200, rate=r, throughput_rps=r) for r in (4.0, 8.0)]  # another trace: left out
    baselines = [line("peft", n, rate=40.0, throughput_rps=t) for n, t in ((5, 0.08), (100, 0.17))]
    baselines += [line("bmm", 5, rate=40.0, throughput_rps=4.9)]
    files = [write(tmp_path / "sat.jsonl", saturation), write(tmp_path / "rate.jsonl", rate),
             write(tmp_path / "base.jsonl", baselines)]
    drawn = plot_all(files, tmp_path / "png")
    png = str(tmp_path / "png" / "systems-throughput-vs-adapters-S2.png")
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert drawn[png]["throughput_rps"] == {
        "base-only": [(100.0, 33.0)], "bmm": [(5.0, 4.9)],
        "loraplex": [(5.0, 29.995), (100.0, 29.9), (2000.0, 28.0)], "peft": [(5.0, 0.08), (100.0, 0.17)]}
    # Without a baseline there is no such figure.
    (tmp_path / "no-baseline").mkdir()
    alone = [write(tmp_path / "no-baseline" / f.name, [json.loads(x) for x in f.read_text().splitlines()])
             for f in files[:2]]
    assert not any("systems-" in p for p in plot_all(alone, tmp_path / "none"))
    # One file of a folder plotted again leaves the figures across the folder's files as they are.
    before = open(png, "rb").read()
    again = plot_all(files[2:], tmp_path / "png")
    assert not any("systems-" in p or "settings-" in p for p in again) and open(png, "rb").read() == before


def test_a_long_legend_goes_beside_the_axes_and_variants_draw_no_limits_of_their_own(tmp_path):
    shipped = "python3 -m shared.cli up --set worker.max_running_requests=384"
    lines = [line(n=n, rate=40.0, throughput_rps=30.0 - n / 1000, roofline_rps=40.0, attainable_rps=39.0,
                  roofline_batch=384, stack_command=shipped) for n in (5, 100, 2000)]
    for margin in range(1, 9):  # eight settings tried at n = 2000: one line each, no roofline each
        lines.append(line(n=2000, rate=40.0, throughput_rps=27.0 + margin / 10, roofline_rps=40.0,
                          attainable_rps=39.0, roofline_batch=384,
                          stack_command=shipped + f" --set worker.decode_margin_steps={margin}"))
    drawn = plot_file(write(tmp_path / "tried.jsonl", lines), tmp_path / "png")
    series = drawn[str(tmp_path / "png" / "tried-throughput-vs-adapters-S2.png")]["throughput_rps"]
    assert [label for label in series if label.endswith((" roofline", " attainable"))] == [
        "as shipped roofline", "as shipped attainable"]
    assert series["decode_margin_steps=3"] == [(2000.0, 27.3)] and len(series) == 11

    import matplotlib.image
    wide = matplotlib.image.imread(tmp_path / "png" / "tried-throughput-vs-adapters-S2.png")
    assert wide.shape[1] > 6.4 * 110  # the legend beside the axes widened the figure past its 6.4 inches


def test_points_on_a_pool_the_sweep_sized_stay_out_of_the_figures_across_files(tmp_path):
    from bench.plots import fixed_pool, plot_settings, plot_systems

    saturation = [line("loraplex", n, rate=40.0, throughput_rps=28.0) for n in (5, 100)]
    saturation += [line("loraplex", 5, rate=40.0, throughput_rps=29.0, setting="S1"),
                   line("loraplex", 100, rate=40.0, throughput_rps=29.5, setting="S1")]
    # The memory-bound comparison (bench/sweeps/s2-memory.yaml): n = 200 in 108k slots. Newer lines name
    # num_slots; older ones only pass --num-slots in their stack command.
    memory = [line("loraplex", 200, rate=40.0, throughput_rps=25.5, num_slots=108000),
              line("no-unify", 200, rate=40.0, throughput_rps=18.9,
                   stack_command="python3 -m shared.cli up --num-slots 108000 --port 1")]
    baselines = [line("bmm", 100, rate=40.0, throughput_rps=3.6, stack_command="python3 -m shared.cli up --port 2")]
    assert [fixed_pool(x) for x in memory + baselines] == [True, True, False]
    files = [write(tmp_path / "sat.jsonl", saturation), write(tmp_path / "mem.jsonl", memory),
             write(tmp_path / "base.jsonl", baselines)]
    systems = plot_systems(files, tmp_path / "png")[str(tmp_path / "png" / "systems-throughput-vs-adapters-S2.png")]
    assert systems["throughput_rps"] == {"bmm": [(100.0, 3.6)], "loraplex": [(5.0, 28.0), (100.0, 28.0)]}
    settings = plot_settings(files, tmp_path / "png")[str(tmp_path / "png" / "settings-throughput-vs-adapters.png")]
    assert all(200.0 not in dict(points) for points in settings["throughput_rps"].values())


def test_points_on_a_sized_pool_get_a_figure_of_what_they_did_with_it(tmp_path):
    peaks = dict(pool_total_slots=108000, running_requests_peak=256)
    memory = [line("loraplex", 200, rate=40.0, throughput_rps=25.5, num_slots=108000, pool_kv_slots_peak=94395,
                   pool_adapter_slots_peak=21472, **peaks),
              line("no-unify", 200, rate=40.0, throughput_rps=18.9, num_slots=108000, pool_kv_slots_peak=53999,
                   pool_adapter_slots_peak=22112, **{**peaks, "running_requests_peak": 149})]
    drawn = plot_file(write(tmp_path / "mem.jsonl", memory))
    png = str(tmp_path / "mem-pool.png")
    assert open(png, "rb").read(8) == PNG_MAGIC
    names = ["S2 loraplex n=200 R=40 cv=1", "S2 no-unify n=200 R=40 cv=1"]
    assert drawn[png]["slots"] == {"KV cache, peak": list(zip(names, (94395.0, 53999.0))),
                                   "adapters, peak": list(zip(names, (21472.0, 22112.0))),
                                   "pool": list(zip(names, (108000.0, 108000.0)))}
    assert drawn[png]["running_requests_peak"] == list(zip(names, (256.0, 149.0)))
    assert drawn[png]["throughput_rps"] == list(zip(names, (25.5, 18.9)))
    assert drawn[png]["preemptions"] == list(zip(names, (0.0, 0.0)))
    # Points on the whole GPU's pool get none, unless it ran short: requests were preempted for KV space.
    whole = [{k: v for k, v in x.items() if k != "num_slots"} for x in memory]
    assert not any(k.endswith("-pool.png") for k in plot_file(write(tmp_path / "whole.jsonl", whole)))
    # Or its last slots all went: a decode reserve preempts nobody and still fills the pool.
    short = [{**whole[0], "preemptions": 1136}, {**whole[1], "preemptions": 0, "pool_used_fraction_peak": 0.6},
             {**whole[0], "n_adapters": 2000, "preemptions": 0, "pool_used_fraction_peak": 0.99998}]
    drawn = plot_file(write(tmp_path / "short.jsonl", short))
    png = str(tmp_path / "short-pool.png")
    assert drawn[png]["preemptions"] == [(names[0], 1136.0), ("S2 loraplex n=2000 R=40 cv=1", 0.0)]


def test_across_files_a_point_is_drawn_once_and_running_batches_get_lines_of_their_own(tmp_path):
    from bench.plots import plot_all

    sat = [line(n=n, setting="S2", rate=40.0, throughput_rps=t, roofline_fraction=0.6, started_at=f"2026-12-01T0{i}")
           for i, (n, t) in enumerate([(5, 30.0), (100, 27.0), (2000, 24.0)])]
    # S2 n = 100 again in a baselines sweep, later: that line is the point's.
    base = [line(n=100, setting="S2", rate=40.0, throughput_rps=28.0, roofline_fraction=0.6, started_at="2026-12-02T00"),
            line("peft", 100, setting="S2", rate=40.0, throughput_rps=0.3, started_at="2026-12-02T00")]
    bigger = [line(n=n, setting="S2", rate=40.0, throughput_rps=t, roofline_fraction=0.65, roofline_batch=384,
                   started_at="2026-12-03T00") for n, t in [(100, 31.0), (2000, 27.0)]]
    gqa = [line(n=n, setting="S-GQA", rate=60.0, throughput_rps=30.0, roofline_fraction=0.5) for n in (5, 100)]
    files = [write(tmp_path / "sat.jsonl", sat), write(tmp_path / "base.jsonl", base),
             write(tmp_path / "bigger.jsonl", bigger), write(tmp_path / "gqa.jsonl", gqa)]
    drawn = plot_all(files, tmp_path / "png")
    throughput = drawn[str(tmp_path / "png" / "settings-throughput-vs-adapters.png")]["throughput_rps"]
    assert throughput["S2 R=40 batch=256"] == [(5.0, 30.0), (100.0, 28.0), (2000.0, 24.0)]
    assert throughput["S2 R=40 batch=384"] == [(100.0, 31.0), (2000.0, 27.0)]
    assert throughput["S-GQA R=60 batch=256"] == [(5.0, 30.0), (100.0, 30.0)]
    systems = drawn[str(tmp_path / "png" / "systems-throughput-vs-adapters-S2.png")]["throughput_rps"]
    assert systems["loraplex batch=256"] == [(5.0, 30.0), (100.0, 28.0), (2000.0, 24.0)]


def test_a_server_setting_tried_on_the_points_draws_a_line_of_its_own(tmp_path):
    from bench.plots import plot_all

    shipped = "python3 -m shared.cli up --set worker.max_batched_tokens=8192 --set worker.max_running_requests=384"
    held = shipped + " --set worker.admission_wait_s=0.5"
    plain = [line(n=n, rate=40.0, throughput_rps=t, roofline_batch=384, stack_command=shipped,
                  started_at="2026-12-03T06") for n, t in [(5, 30.1), (2000, 27.3)]]
    tried = [line(n=n, rate=40.0, throughput_rps=t, roofline_batch=384, stack_command=held,
                  started_at="2026-12-03T08") for n, t in [(5, 26.8), (2000, 23.3)]]
    # One file holding both: the later lines are a variant of the points, not a rerun replacing them.
    (tmp_path / "one").mkdir()
    both = write(tmp_path / "one" / "both.jsonl", plain + tried)
    assert sorted((x["variant"], x["throughput_rps"]) for x in read_lines(both)) == [
        ("", 27.3), ("", 30.1), ("admission_wait_s=0.5", 23.3), ("admission_wait_s=0.5", 26.8)]
    drawn = plot_all([write(tmp_path / "plain.jsonl", plain), write(tmp_path / "tried.jsonl", tried)], tmp_path / "png")
    throughput = drawn[str(tmp_path / "png" / "settings-throughput-vs-adapters.png")]["throughput_rps"]
    assert throughput["as shipped"] == [(5.0, 30.1), (2000.0, 27.3)]
    assert throughput["admission_wait_s=0.5"] == [(5.0, 26.8), (2000.0, 23.3)]


def test_a_variant_names_every_setting_it_tried_and_ignores_the_others():
    from bench.plots import variant_of

    command = ("python3 -m shared.cli up --set worker.max_batched_tokens=8192 --set worker.overlap_steps=true "
               "--set worker.max_running_requests=384 --set worker.admission_wait_s=0.5")
    assert variant_of({"stack_command": command}) == "overlap_steps=true admission_wait_s=0.5"
    assert variant_of({"stack_command": "python3 -m shared.cli up --set worker.max_running_requests=384"}) == ""
    assert variant_of({}) == ""  # a line from a server without a stack command (the PEFT baseline's own)
    # A launch shape's value holds '=' itself.
    shaped = ("python3 -m shared.cli up --set worker.kernel_shapes=attention_block_n=64,split_mixed "
              "--set worker.kv_slot_run=16 --set worker.max_running_requests=384")
    assert variant_of({"stack_command": shaped}) == "kernel_shapes=attention_block_n=64,split_mixed kv_slot_run=16"
    # A larger pool is a variant too, so its line counts for no target until it is the default.
    pooled = "python3 -m shared.cli up --set worker.pool_memory_fraction=0.92 --set worker.max_running_requests=384"
    assert variant_of({"stack_command": pooled}) == "pool_memory_fraction=0.92"


def test_every_setting_a_sweep_sets_shapes_its_points_or_makes_its_lines_a_variant():
    """A sweep that tries a setting the plots do not know as a variant writes lines that replace the shipped
    point's and count for its target (worker.decode_margin_steps did, until it was named here)."""
    import re

    from bench import REPO
    from bench.plots import POINT_SETTINGS, VARIANT_SETTINGS

    seen = 0
    for spec in sorted((REPO / "bench" / "sweeps").glob("*.yaml")):
        for key in re.findall(r"(worker\.\w+)=", spec.read_text()):
            assert key in POINT_SETTINGS + VARIANT_SETTINGS, f"{spec.name} sets {key}, neither a point's shape nor a variant"
            seen += 1
    assert seen > 100


def test_worker_steps_figure_keeps_a_band_for_each_window_of_one_point(tmp_path):
    """The same point over a 140 s and an 80 s window is two lines read_lines keeps; the figure names them
    apart instead of drawing one over the other in a single band."""
    long = line("loraplex", 2000, rate=40.0, duration_s=140.0, started_at="2026-12-07T16:48:50+00:00",
                worker_steps=steps((5000, 110.0), (0, 0.0), (250, 50.0)))
    short = line("loraplex", 2000, rate=40.0, duration_s=80.0, started_at="2026-12-07T19:22:01+00:00",
                 worker_steps=steps((3000, 60.0), (0, 0.0), (150, 30.0)))
    drawn = plot_file(write(tmp_path / "h100.jsonl", [long, short]))
    graph = drawn[str(tmp_path / "h100-worker-steps.png")]["mean_ms"]["graph"]
    assert [label for label, _ in graph] == ["S2 loraplex n=2000 R=40 cv=1 (140 s, 12-07 16:48)",
                                             "S2 loraplex n=2000 R=40 cv=1 (80 s, 12-07 19:22)"]
    assert [ms for _, ms in graph] == [pytest.approx(22.0), pytest.approx(20.0)]


def test_a_line_is_drawn_at_the_running_cap_its_stack_set_not_the_batch_its_pool_left(tmp_path):
    from bench.plots import read_lines

    capped = "python3 -m shared.cli up --set worker.max_running_requests=384"
    # Two hosts' pools left the roofline 300 and 303 rows at one setting: one server, one series.
    lines = [line(n=2000, rate=40.0, throughput_rps=23.0, roofline_batch=300, stack_command=capped,
                  started_at="2026-12-07T19"),
             line(n=2000, rate=40.0, throughput_rps=23.2, roofline_batch=303, stack_command=capped,
                  started_at="2026-12-07T22"),
             line(n=5, rate=40.0, throughput_rps=27.0, roofline_batch=299, stack_command=capped)]
    assert [x["batch"] for x in read_lines(write(tmp_path / "h100.jsonl", lines))] == [384, 384]
    # The same point in longer windows, measured before: a line of its own for the steps, no second point here.
    lines.append(line(n=2000, rate=40.0, throughput_rps=20.5, roofline_batch=303, stack_command=capped,
                      duration_s=160.0, started_at="2026-12-07T16"))
    assert len(read_lines(write(tmp_path / "h100.jsonl", lines))) == 3
    series = plot_file(tmp_path / "h100.jsonl", tmp_path / "png")[
        str(tmp_path / "png" / "h100-throughput-vs-adapters-S2.png")]["throughput_rps"]
    assert series["loraplex"] == [(5.0, 27.0), (2000.0, 23.2)]  # the later n = 2000 line replaced the earlier
    # A line whose stack set no cap ran the default, which its roofline assumed.
    assert read_lines(write(tmp_path / "old.jsonl", [line(roofline_batch=256)]))[0]["batch"] == 256
