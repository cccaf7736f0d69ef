"""The serving targets, read off the result lines: each target's measured value, the bound its points' rooflines put on
it, and a verdict, as a markdown table (`loraplex bench targets`).

A ratio target (n = 2000 against n = 5, loraplex against base-only) compares two points of one trace whose rooflines
differ (a step at n = 2000 reads ~240 adapters' rows that n = 5 never reads): the rooflines' own ratio is what two
servers at 100% of their rooflines would give at the running batch the rooflines assume (the server's, 256), so a
target above it cannot be met by a faster server at that batch. Points are the saturation points (cv = 1, alpha = 1,
early abort) at the highest rate measured, each its latest line (`plots.read_lines`), on the whole GPU's pool
(`plots.fixed_pool`). The PEFT ratio asks for both points "measured in the same run": both lines must carry the same
`run` (bench/driver.py); where the latest lines are of two runs, the latest run that measured both stands for the
target (the later lines' ratio in its status), and with none its status says the lines are of two runs. Lines that
tried a server setting on the points (`variant`, plots.VARIANT_SETTINGS) are not the server as it ships and are left
out. Two loraplex points run at different running batches (`batch`, which read_lines takes from the line's
`roofline_batch`, set by a sweep's worker.max_running_requests) are not compared: the status says so. A ratio of two
lines whose `server_code` (bench/point.py: the server source's fingerprint) differs says so too: a change to the
server between the points moves the ratio as much as the adapters do. The targets are set for one GPU (the H200): a
line that names another in its `gpu` is left out, so a point measured on an H100 neither stands for the H200's nor
enters a ratio with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.plot_steps import KINDS, worker_steps
from bench.plots import fixed_pool, read_lines

ROOFLINE_TARGET = 0.6
TARGET_GPU = "H200"  # matched within a line's `gpu` (the device's name, e.g. "NVIDIA H200")
# The targets, in its order: (setting, n, req/s) for the absolute one; (setting, numerator,
# denominator, factor, both from one run) for the ratios, each side a (system, n).
ABSOLUTE = ("S2", 2000, 30.0)
RATIOS = (
    ("S2", ("loraplex", 2000), ("loraplex", 5), 0.9, False),
    ("S2", ("loraplex", 100), ("base-only", 100), 0.9, False),
    ("S2", ("loraplex", 100), ("peft", 100), 30.0, True),
)
# Baselines measured on loraplex's trace without a roofline of their own: a ratio against them has no bound.
UNBOUNDED_SYSTEMS = ("peft", "merge")


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: str
    bound: str  # what the rooflines allow ("" when the target is not a ratio)
    status: str  # met, missed, beyond the roofline, not measured

    def row(self) -> str:
        return f"| {self.target} | {self.measured} | {self.bound or '—'} | {self.status} |"


def on_gpu(line: dict, gpu: str) -> bool:
    """Whether a line was measured on `gpu` (a part of the device's name); a line naming no GPU counts."""
    return not line.get("gpu") or gpu.lower() in str(line["gpu"]).lower()


def _saturation_lines(paths: list[str | Path], gpu: str):
    for path in paths:
        for line in read_lines(path):
            if line["cv"] != 1 or line["alpha"] != 1 or line["policy"] != "early-abort":
                continue
            if line.get("throughput_rps") is None or fixed_pool(line) or line["variant"]:
                continue
            if on_gpu(line, gpu):
                yield line


def _keep_best(best: dict, line: dict) -> None:
    key = (line["setting"], line["system"], int(line["n_adapters"]))
    if key not in best or _rate_then_time(line) > _rate_then_time(best[key]):
        best[key] = line


def saturation_points(paths: list[str | Path], gpu: str = TARGET_GPU) -> dict[tuple[str, str, int], dict]:
    """(setting, system, n) -> the line at the highest rate of the plain saturation points on `gpu`."""
    best: dict[tuple[str, str, int], dict] = {}
    for line in _saturation_lines(paths, gpu):
        _keep_best(best, line)
    return best


def run_points(paths: list[str | Path], gpu: str = TARGET_GPU) -> dict[str, dict[tuple[str, str, int], dict]]:
    """run -> its saturation points as `saturation_points` picks them, for the lines that name their run."""
    runs: dict[str, dict[tuple[str, str, int], dict]] = {}
    for line in _saturation_lines(paths, gpu):
        if line.get("run"):
            _keep_best(runs.setdefault(line["run"], {}), line)
    return runs


def ratio_lines(points: dict, runs: dict, setting: str, num: tuple[str, int], den: tuple[str, int],
                same_run: bool) -> tuple[dict | None, dict | None, bool]:
    """The two lines a ratio compares, and whether they stand in for the latest lines. Each side's latest
    line, except where the target asks for one run and the latest lines are of two: then the latest run that
    measured both sides (runs are named by their start time)."""
    a, b = points.get((setting, *num)), points.get((setting, *den))
    if not same_run or a is None or b is None or one_run(a, b):
        return a, b, False
    both = [run for run, p in runs.items() if (setting, *num) in p and (setting, *den) in p]
    if not both:
        return a, b, False
    latest = runs[max(both)]
    return latest[(setting, *num)], latest[(setting, *den)], True


def _rate_then_time(line: dict) -> tuple:
    return line["req_rate"], line.get("started_at", "")


def _day(line: dict) -> str:
    return str(line.get("started_at", line.get("date", "")))[:10]


def absolute_name(setting: str, n: int, floor_rps: float) -> str:
    return f"{setting} n = {n} ≥ {floor_rps:g} req/s"


def absolute(points: dict, setting: str, n: int, floor_rps: float) -> Verdict:
    target = absolute_name(setting, n, floor_rps)
    p = points.get((setting, "loraplex", n))
    if p is None:
        return Verdict(target, "", "", "not measured")
    rps, roof = p["throughput_rps"], p.get("roofline_rps")
    bound = f"needs {floor_rps / roof:.2f} of its roofline ({roof:.1f} req/s)" if roof else ""
    attainable = p.get("attainable_rps")
    if roof and attainable:
        # GEMMs past the ridge point bound by their FLOPs: the most any server reaches at this batch.
        bound += f"; every operation at its binding ceiling: {attainable:.1f} req/s ({attainable / roof:.2f} of it)"
    status = "met" if rps >= floor_rps else f"missed: {rps / floor_rps:.2f} of it"
    if roof and floor_rps > roof:
        status += ", beyond the roofline"
    if rps < floor_rps and gpu_busy(p) is not None:
        status += f"; GPU busy {gpu_busy(p):.0%} of the point"
    where = steps_against_floors(p) if rps < floor_rps else ""
    if where:
        status += f"; {where}"
    return Verdict(target, f"{rps:.1f} req/s ({_day(p)})", bound, status)


def gpu_busy(p: dict) -> float | None:
    """A line's busy share over its measured window; older lines carry only the whole run's,
    warm-up included."""
    window = p.get("gpu_busy_window_mean")
    return window if window is not None else p.get("gpu_busy_mean")


def one_run(a: dict, b: dict) -> bool:
    """Both lines from one `loraplex bench sweep` command (the `run` the driver stamps; older lines have none)."""
    return bool(a.get("run")) and a.get("run") == b.get("run")


def ratio_name(setting: str, num: tuple[str, int], den: tuple[str, int], factor: float) -> str:
    side = lambda s, n: f"n = {n}" if s == "loraplex" else f"{s} n = {n}"  # noqa: E731
    return f"{setting} {side(*num)} ≥ {factor:g} × {side(*den)}"


def rooflines_ratio(a: dict, b: dict) -> float | None:
    """What two servers at 100% of their rooflines would give; none against a baseline without a roofline of
    its own."""
    ra, rb = a.get("roofline_rps"), b.get("roofline_rps")
    return ra / rb if ra and rb and b["system"] not in UNBOUNDED_SYSTEMS else None


def ratio(points: dict, setting: str, num: tuple[str, int], den: tuple[str, int], factor: float,
          same_run: bool = False, runs: dict | None = None) -> Verdict:
    """num's throughput ≥ factor × den's; both (system, n) of one setting. With same_run the target asks for
    both points from one run: the latest run of both (`ratio_lines`, from `runs`) where the latest lines are
    of two, and a ratio of two runs' lines says so in its status."""
    target = ratio_name(setting, num, den, factor)
    a, b, of_one_run = ratio_lines(points, runs or {}, setting, num, den, same_run)
    if a is None or b is None:
        return Verdict(target, "", "", "not measured")
    measured = a["throughput_rps"] / b["throughput_rps"]
    when = f"one run, {_day(a)}" if one_run(a, b) else f"{_day(a)}, {_day(b)}"
    text = f"{a['throughput_rps']:.1f} / {b['throughput_rps']:.2f} = {measured:.2f}× ({when})"
    bound, status = "", "met" if measured >= factor else "missed"
    limit = rooflines_ratio(a, b)
    if limit is not None:
        bound = f"rooflines' ratio {limit:.3f}"
        if measured < factor and limit < factor:
            status = "missed, beyond the roofline"
    if same_run and not one_run(a, b):
        status += ", but not from one run"
    if of_one_run:
        # The later lines measured each side again, apart: their ratio, beside the one run's.
        la, lb = points[(setting, *num)], points[(setting, *den)]
        status += (f"; the latest lines, of two runs: {la['throughput_rps']:.1f} / {lb['throughput_rps']:.2f} = "
                   f"{la['throughput_rps'] / lb['throughput_rps']:.2f}× ({_day(la)}, {_day(lb)})")
    if a.get("server_code") and b.get("server_code") and a["server_code"] != b["server_code"]:
        # A change to the server between the points moves the ratio as much as the adapters do.
        status += f", but served by different code ({a['server_code']}, {b['server_code']})"
    if b["system"] not in UNBOUNDED_SYSTEMS and a["batch"] != b["batch"]:
        # A larger running batch shares a step's fixed part (weights, adapters' rows) among more tokens:
        # two points at different caps measure the caps as much as the adapters.
        status = f"not comparable: running batches {a['batch']} and {b['batch']} (measure both at one)"
    if measured < factor and worker_steps(a) and worker_steps(b):
        status += f"; {where_the_time_goes(worker_steps(a), worker_steps(b))}"
    if measured < factor and gpu_busy(a) is not None and gpu_busy(b) is not None:
        # Below 100% the GPU waited on the host: time no kernel can win back.
        status += f"; GPU busy {gpu_busy(a):.0%} vs {gpu_busy(b):.0%}"
    return Verdict(target, text, bound, status)


def where_the_time_goes(a: dict, b: dict) -> str:
    """Two points' worker steps side by side (bench/metrics.py `worker_steps`): each kind's mean step and
    share of step time, first point then second, for the kinds either ran, with the tokens a mean step ran, the
    host's launch and the adapters' rows a mean step read where the lines carry them."""
    def ms(s: dict) -> str:
        return f"{s['mean_ms']:.1f}" if s.get("mean_ms") is not None else "—"

    def share(s: dict) -> str:
        return f"{s['share']:.0%}" if s.get("share") is not None else "—"

    parts = []
    for kind, name in KINDS:
        x, y = a.get(kind) or {}, b.get(kind) or {}
        if not (x.get("steps") or y.get("steps")):
            continue
        part = f"{name} steps {ms(x)} vs {ms(y)} ms ({share(x)} vs {share(y)} of step time"
        if x.get("tokens") and y.get("tokens"):
            # Fewer tokens a step at the same step time is a smaller running batch (a pool that binds sooner,
            # its adapters holding slots the KV cache would use), not slower kernels.
            part += f"; {x['tokens'] / x['steps']:.0f} vs {y['tokens'] / y['steps']:.0f} tokens a step"
        if x.get("launch_ms") is not None and y.get("launch_ms") is not None:
            part += f"; launched by the host in {x['launch_ms']:.1f} vs {y['launch_ms']:.1f} ms"
        if x.get("floor_ms") is not None and y.get("floor_ms") is not None:
            # Each operation at its binding ceiling (bench/step_floor.py): how near the steps run to their work.
            part += (f"; floors {x['floor_ms']:.1f} vs {y['floor_ms']:.1f} ms, the steps at "
                     f"{x['of_floor']:.2f} vs {y['of_floor']:.2f} of them")
        if x.get("adapters_mean") is not None and y.get("adapters_mean") is not None:
            # The part of a step that grows with the adapters served: their rows, read beside weights and KV.
            part += (f"; rows of {x['adapters_mean']:.0f} vs {y['adapters_mean']:.0f} adapters read, "
                     f"{x['adapter_mb_mean'] / 1e3:.2f} vs {y['adapter_mb_mean'] / 1e3:.2f} GB a step")
        parts.append(part + ")")
    return ", ".join(parts)


def steps_against_floors(line: dict) -> str:
    """Where a point's worker time went, kind by kind: the mean step, its share of step time and how near it
    ran to its floor (bench/step_floor.py), and the throughput the same steps would give at their floors, the
    point's divided by the step time's share its floors make up (lines from 2026-12-05 carry the floors; ""
    for a line without them)."""
    steps = worker_steps(line) or {}
    ran = [(name, steps[kind]) for kind, name in KINDS if (steps.get(kind) or {}).get("steps")]
    if not ran or any(s.get("of_floor") is None or s.get("share") is None for _, s in ran):
        return ""
    parts = [f"{name} steps {s['mean_ms']:.1f} ms ({s['share']:.0%} of step time) at {s['of_floor']:.2f} of their "
             f"{s['floor_ms']:.1f} ms floor" + _gpu_part(s) + _captured(s) for name, s in ran]
    at_floors = sum(s["share"] * s["of_floor"] for _, s in ran)
    return (", ".join(parts) + _idle_part([s for _, s in ran])
            + f"; the same steps at their floors: {line['throughput_rps'] / at_floors:.1f} req/s")


def _gpu_part(s: dict) -> str:
    """The GPU's own time of a mean step, first kernel to last (lines from 2026-12-06 10:30 on). Kind by kind it
    is not the step's time less the stream's idle time: a step launched ahead whose kernels the host issues
    slowly is charged that time in its own GPU interval, and in the wall time of the step before it, whose tokens
    the host reads only once it has issued them (_idle_part)."""
    if not s.get("gpu_ms"):
        return ""
    return f", the GPU running {s['gpu_ms']:.1f} ms of each"


def _idle_part(ran: list[dict]) -> str:
    """The share of step time the stream sat idle between steps (from one step's last kernel to the next one's
    first), every kind's GPU intervals against every kind's steps, whichever kind each slow launch is charged
    to. A wait on the host inside a step's interval is not in it."""
    if not all(s.get("gpu_ms") for s in ran):
        return ""
    wall = sum(s["steps"] * s["mean_ms"] for s in ran)
    busy = sum(s["steps"] * s["gpu_ms"] for s in ran)
    return f"; the stream idle {max(0.0, 1 - busy / wall):.0%} of step time"


def _captured(s: dict) -> str:
    """Graphs those steps captured under load (lines from 2026-12-06 10:00 on carry them) and kernels built
    while they were issued, when any were: their seconds are inside the steps' time, outside any floor."""
    said = []
    if s.get("captures"):
        said.append(f"{s['captures']} graphs captured under load in them, {s['capture_s']:.1f} s")
    if s.get("builds"):  # lines from 2026-12-06 17:00 on carry them
        said.append(f"{s['builds']} kernels built under load in them, {s['build_s']:.1f} s")
    return f" ({'; '.join(said)})" if said else ""


def fraction_points(points: dict) -> list[tuple[tuple[str, str, int], dict]]:
    """loraplex's points that carry a roofline fraction, by setting and n."""
    return sorted((k, p) for k, p in points.items() if k[1] == "loraplex" and p.get("roofline_fraction") is not None)


def roofline_fractions(points: dict) -> Verdict:
    lines = fraction_points(points)
    if not lines:
        return Verdict(f"≥ {ROOFLINE_TARGET:.0%} of the roofline", "", "", "not measured")
    parts = [f"{s} n = {n} {p['roofline_fraction']:.2f}" + _attainable_share(p) + _held_share(p)
             for (s, _, n), p in lines]
    met = [f"{s} n = {n}" for (s, _, n), p in lines if p["roofline_fraction"] >= ROOFLINE_TARGET]
    missed = [((s, n), p) for (s, _, n), p in lines if p["roofline_fraction"] < ROOFLINE_TARGET]
    if not missed:
        return Verdict(f"≥ {ROOFLINE_TARGET:.0%} of the roofline", "; ".join(parts), "", "met at every point")
    # By how much each point under the target misses it (its fraction over the target's).
    by = ", ".join(f"{s} n = {n} ({p['roofline_fraction'] / ROOFLINE_TARGET:.2f} of it)" for (s, n), p in missed)
    status = (f"met at {', '.join(met)}; missed at {by}" if met else f"missed at every point: {by}")
    # Where the time of each point under the target went, from its steps' floors; a line measured before lines
    # carried them (2026-12-05) says so, rather than leaving its point unexplained.
    for (s, n), p in missed:
        where = steps_against_floors(p)
        status += f"; {s} n = {n}: " + (where or f"its line ({_day(p)}) carries no step floors")
    return Verdict(f"≥ {ROOFLINE_TARGET:.0%} of the roofline", "; ".join(parts), "", status)


def _attainable_share(line: dict) -> str:
    """" (at most X)": the share of its roofline a server with every operation at its binding ceiling would
    reach, where the line records it."""
    share = attainable_share(line)
    return f" (at most {share:.2f})" if share is not None else ""


def _held_share(line: dict) -> str:
    """" [0.60 at the held matmul rate]": the fraction against the roofline at the matmul rate the GPU holds
    under its power limit (bench/held_matmul.py), where the line records it; the target reads the other."""
    held = line.get("roofline_fraction_held")
    return f" [{held:.2f} at the held matmul rate]" if held is not None else ""


def attainable_share(line: dict) -> float | None:
    """The attainable throughput (every operation at its binding ceiling) over the roofline, where recorded."""
    roof, attainable = line.get("roofline_rps"), line.get("attainable_rps")
    return attainable / roof if roof and attainable else None


def verdicts(paths: list[str | Path], gpu: str = TARGET_GPU) -> list[Verdict]:
    """The issue's serving targets (docs/benchmarks.md), in its order, from the lines measured on `gpu`."""
    points, runs = saturation_points(paths, gpu), run_points(paths, gpu)
    return [absolute(points, *ABSOLUTE),
            *(ratio(points, s, num, den, factor, same_run=one, runs=runs) for s, num, den, factor, one in RATIOS),
            roofline_fractions(points)]


def table(paths: list[str | Path], gpu: str = TARGET_GPU) -> str:
    rows = ["| target | measured | what the rooflines allow | status |", "|---|---|---|---|"]
    return "\n".join(rows + [v.row() for v in verdicts(paths, gpu)]) + "\n"
