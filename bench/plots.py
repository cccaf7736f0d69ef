"""Figures from the result lines of docs/bench/*.jsonl (matplotlib, Agg, PNG).

- throughput vs number of adapters: one figure per setting, a line per system (and rate, cv, policy where
  the file holds several), log-scaled n; a system measured at one n only is a single point; loraplex's and
  base-only's rooflines (`roofline_rps`) dashed beside them, so a target's distance from the limit shows,
  and where lines record it the attainable throughput (`attainable_rps`, every operation at the ceiling
  that binds it, bench/roofline.py) dotted;
- throughput and SLO attainment vs request rate: one figure per setting, a line per system and n;
- SLO attainment and user satisfaction vs cv: one figure per setting, a line per admission policy;
- where each point's worker time went (steps by kind), for lines that record it (bench/plot_steps.py);
- the peak KV and adapter slots of points on a pool the sweep sized, or on a whole GPU's pool that ran short
  (requests preempted), against it (bench/plot_pool.py);
- over all files, when they are every result file of their folders: loraplex's throughput and roofline
  fraction vs n, a line per setting (`plot_settings`), and every system measured on a baseline's trace vs n,
  log-scaled throughput (`plot_systems`): loraplex and base-only live in the saturation sweeps, the baselines
  in their own, and they differ by 100x or more; both leave out points measured on a pool the sweep sized
  (`fixed_pool`).
Otherwise a line is drawn only where its x varies (two points at least). A point measured twice counts once (the
later line: a rerun replaces it). `plot_file` returns what it drew, figure by figure, read back from the
figures' own lines, so a caller (or a test) sees exactly the plotted series.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from bench.plot_pool import plot_pool
from bench.roofline import MAX_RUNNING
from bench.plot_steps import plot_steps

ROOFLINE_SYSTEMS = ("loraplex", "base-only")  # the systems the targets compare; other baselines share the trace
ROOFLINE = " roofline"  # label suffix of a roofline series, drawn dashed
ATTAINABLE = " attainable"  # label suffix of an attainable-throughput series, drawn dotted
OFFERED = "offered"  # the rate the load client sent, drawn dashed in grey: served = offered below capacity
GROUP_KEYS = ("setting", "system", "n_adapters", "alpha", "req_rate", "cv", "policy")
LABEL_SHORT = {"n_adapters": "n", "req_rate": "R", "alpha": "alpha", "cv": "cv", "policy": "", "system": "", "setting": "",
               "batch": "batch", "variant": "", "card": ""}
# A line's curve also depends on the running batch its stack was capped at (a sweep's
# worker.max_running_requests; the roofline assumes it) and on any server setting tried on the same points
# (VARIANT_SETTINGS), and on the GPU that served it (a point measured on an H100 neither replaces the H200's
# line nor joins its curve): read_lines adds them as `batch`, `variant` and `card`.
SERIES_KEYS = GROUP_KEYS + ("batch", "variant", "card")
# Settings a sweep sets to try a change of the server's behaviour on points other sweeps measure as shipped
# (bench/sweeps/s2-batch384-wait.yaml, -overlap.yaml, -direct.yaml; launch shapes and slot runs a kernel run
# favoured, benchmarks/kernels/pick_shapes.py). A line run with one is a variant of its point: it neither
# replaces the point's line nor counts for the targets, and the figures draw it as a line of its own.
VARIANT_SETTINGS = ("worker.admission_wait_s", "worker.overlap_steps", "worker.overlap_admission",
                    "worker.direct_launch", "worker.kernel_shapes", "worker.kv_slot_run",
                    "worker.pool_memory_fraction", "worker.pool_headroom_gb", "worker.decode_reserve",
                    "worker.decode_margin_steps", "worker.admission_batch", "worker.overlap_ending_slots")
# Settings that shape the points themselves (the running batch, the graphs' and prefill's bounds, the rank
# the pool is sized for): every sweep sets them alike for its setting, so a line is no variant for them.
POINT_SETTINGS = ("worker.max_running_requests", "worker.max_batched_tokens", "worker.max_lora_rank",
                  "worker.cuda_graph_max_batch", "worker.cuda_graph_max_context")
LEGEND_INSIDE = 8  # the most series a legend lists inside its axes
LEGEND_WIDTH_IN = 4.8  # the width a legend beside the axes takes (labels of ~50 characters at 7 pt)
DEFAULT_VARIANT = "as shipped"  # the label of the lines run without any of them, where a figure holds both


def fixed_pool(line: dict) -> bool:
    """Whether the point's stack ran on a pool the sweep sized (`num_slots`: the memory-bound comparison of
    bench/sweeps/s2-memory.yaml) rather than on the whole GPU: a smaller server, left out of the figures and
    targets that compare points across files. Older lines say so in their stack command only."""
    return bool(line.get("num_slots")) or "--num-slots" in (line.get("stack_command") or "")


def pool_ran_full(line: dict) -> bool:
    """Whether the point's pool bound it: requests preempted, or admission holding requests back with the
    pool full (a decode reserve preempts nobody and still runs the pool to its last slots)."""
    return (line.get("preemptions") or 0) > 0 or (line.get("pool_used_fraction_peak") or 0) >= 0.999


def read_lines(path: str | Path) -> list[dict]:
    """Result lines of one file, a point measured again replacing its earlier line."""
    by_point: dict[tuple, dict] = {}
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
        missing = [k for k in GROUP_KEYS if k not in line]
        if missing:
            raise ValueError(f"{path}:{number}: result line lacks {', '.join(missing)}")
        line["batch"] = running_cap(line)
        line["variant"] = variant_of(line)
        line["card"] = card_of(line)
        by_point[tuple(line[k] for k in SERIES_KEYS) + (line.get("duration_s"),)] = line
    return list(by_point.values())


def running_cap(line: dict) -> int:
    """The running batch the line's stack was capped at: the `worker.max_running_requests` its stack command
    set, else the batch its roofline assumed (lines before it was a setting ran the default). Not the roofline's
    own batch where both are known: a pool that binds lowers that by host and adapters, the server's cap stays."""
    found = re.search(r"--set worker\.max_running_requests=(\d+)", line.get("stack_command") or "")
    return int(found.group(1)) if found else int(line.get("roofline_batch") or MAX_RUNNING)


def card_of(line: dict) -> str:
    """The GPU's model in a line's device name ("NVIDIA H100 80GB HBM3" -> "H100"; "" for a line naming none)."""
    words = str(line.get("gpu") or "").replace("NVIDIA", "").split()
    return words[0] if words else ""


def variant_of(line: dict) -> str:
    """The VARIANT_SETTINGS the line's stack was started with, as `name=value` ("" for none), read from its
    stack command, which every line records."""
    found = re.findall(r"--set (\S+?)=(\S+)", line.get("stack_command") or "")
    return " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in found if key in VARIANT_SETTINGS)


def latest_per_point(lines: list[dict]) -> list[dict]:
    """Lines of several files, one per point (the latest started): a point two sweeps measured (S2 n = 100 in
    the saturation and the baselines sweeps) is drawn once."""
    by_point: dict[tuple, dict] = {}
    for line in lines:
        key = tuple(line[k] for k in SERIES_KEYS)
        if key not in by_point or line.get("started_at", "") >= by_point[key].get("started_at", ""):
            by_point[key] = line
    return list(by_point.values())


def _series(lines: list[dict], x: str, y: str, figure_keys: tuple[str, ...], min_points: int = 2,
            keep=None) -> dict[tuple, dict[str, list]]:
    """{figure key: {label: sorted [(x, y)]}}, lines = every group key but x; only lines with `min_points`+
    points, and only figures with one line of 2+ points at least. With `keep`, only the lines whose points
    it keeps are returned, named as among all of them (a roofline then keeps the name of the line it bounds)."""
    line_keys = tuple(k for k in SERIES_KEYS if k != x and k not in figure_keys)
    grouped: dict[tuple, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    kept: set[tuple] = set()
    for line in lines:
        if line.get(y) is None:
            continue
        key = tuple(line[k] for k in line_keys)
        grouped[tuple(line[k] for k in figure_keys)][key].append((line[x], line[y]))
        if keep is None or keep(line):
            kept.add(key)
    out: dict[tuple, dict[str, list]] = {}
    for fig, by_line in grouped.items():
        by_line = {k: sorted(v) for k, v in by_line.items() if len({p[0] for p in v}) >= min_points}
        if not any(len({p[0] for p in v}) >= 2 for v in by_line.values()):
            continue
        # Name each line by what tells it apart from the others in its figure.
        varying = [i for i, k in enumerate(line_keys) if len({key[i] for key in by_line}) > 1] or [0]
        out[fig] = {_label(line_keys, key, varying): pts for key, pts in sorted(by_line.items(), key=lambda kv: str(kv[0]))
                    if key in kept}
    return out


def _bounded(line: dict) -> bool:
    """Whether a line's limits are drawn: loraplex's and base-only's, as shipped."""
    return line["system"] in ROOFLINE_SYSTEMS and not line["variant"]


def _label(keys: tuple[str, ...], values: tuple, varying: list[int]) -> str:
    parts = []
    for i in varying:
        short = LABEL_SHORT.get(keys[i], keys[i])
        if keys[i] == "variant":
            parts.append(values[i] or DEFAULT_VARIANT)
            continue
        parts.append(f"{short}={values[i]:g}" if short and isinstance(values[i], (int, float)) else
                     f"{short}={values[i]}" if short else str(values[i]))
    return " ".join(parts)


def _figure(panels: list[tuple[str, str, dict[str, list]]], title: str, xlabel: str, logx: bool, path: Path,
            log_base: int = 10, logy: bool = False) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    drawn, outside = {}, False
    for ax, (ylabel, key, series) in zip(axes[0], panels):
        colors: dict[str, str] = {}  # a roofline takes the colour of the line it bounds
        for label, pts in series.items():
            bounded = label.removesuffix(ROOFLINE).removesuffix(ATTAINABLE)
            color = "grey" if label == OFFERED else colors.setdefault(bounded, f"C{len(colors)}")
            dashed = label.endswith((ROOFLINE, ATTAINABLE)) or label == OFFERED
            style = {"marker": "o"}
            if dashed:
                style = {"linestyle": ":" if label.endswith(ATTAINABLE) else "--", "marker": "x", "alpha": 0.7}
            if len(pts) == 1 and not dashed:  # a lone point drawn over the lines it may sit on
                style = {"marker": "D", "markersize": 8, "zorder": 3}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, **style)
        if logx:
            ax.set_xscale("log", base=log_base)
            if log_base != 10:  # doubling steps (cv 1, 2, 4, 8) read best labelled with their own values
                xs = sorted({p[0] for pts in series.values() for p in pts})
                ax.set_xticks(xs, [f"{x:g}" for x in xs])
        if logy:  # series orders of magnitude apart: equal ratios read as equal gaps
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)  # ratios between lines read true only from a zero baseline
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(series) > LEGEND_INSIDE:  # a legend this long would hide the lines: it goes beside the axes
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
            outside = True
        else:
            ax.legend(fontsize=8)
        drawn[key] = {line.get_label(): list(zip(map(float, line.get_xdata()), map(float, line.get_ydata())))
                      for line in ax.get_lines()}
    fig.suptitle(title)
    if outside:  # room for the legend beside the last axes, the axes keeping their size
        width, height = fig.get_size_inches()
        fig.set_size_inches(width + LEGEND_WIDTH_IN, height)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight" if outside else None)
    plt.close(fig)
    return drawn


def plot_file(path: str | Path, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Every figure the file's points support; {png path: {panel (y field): {label: [(x, y)]}}}."""
    path = Path(path)
    out_dir = Path(out_dir) if out_dir is not None else path.parent
    steps_lines = read_lines(path)  # a point measured in windows of two lengths keeps a line each here
    lines = latest_per_point(steps_lines)  # and is drawn once, the latest, where it is a point on a curve
    stem = path.stem
    written: dict[str, dict] = {}

    # A system measured at one n only (base-only or PEFT beside a loraplex sweep, say) shows as a point. Limits
    # are drawn for the points as shipped (a variant runs the same trace; limits beside each of its lines would
    # crowd the figure out), named among all the file's lines as the lines they bound are, to take their colour.
    limits = _series(lines, "n_adapters", "roofline_rps", ("setting",), min_points=1, keep=_bounded)
    reachable = _series(lines, "n_adapters", "attainable_rps", ("setting",), min_points=1, keep=_bounded)
    for (setting,), series in _series(lines, "n_adapters", "throughput_rps", ("setting",), min_points=1).items():
        series = {**series, **{label + ROOFLINE: pts for label, pts in limits.get((setting,), {}).items()},
                  **{label + ATTAINABLE: pts for label, pts in reachable.get((setting,), {}).items()}}
        png = out_dir / f"{stem}-throughput-vs-adapters-{setting}.png"
        written[str(png)] = _figure([("throughput (req/s)", "throughput_rps", series)],
                                    f"{setting}: throughput vs number of adapters", "adapters (n)", True, png)

    by_rate = _series(lines, "req_rate", "throughput_rps", ("setting",))
    slo_by_rate = _series(lines, "req_rate", "slo_attainment", ("setting",))
    offered = _series([x for x in lines if "offered_rps" in x], "req_rate", "offered_rps", ("setting",))
    for (setting,), series in by_rate.items():
        sent = next(iter(offered.get((setting,), {}).values()), None)  # the same trace for every system
        if sent:
            series = {**series, OFFERED: sent}
        png = out_dir / f"{stem}-rate-{setting}.png"
        written[str(png)] = _figure([("throughput (req/s)", "throughput_rps", series),
                                     ("SLO attainment (first token < 6 s)", "slo_attainment",
                                      slo_by_rate.get((setting,), {}))],
                                    f"{setting}: throughput and SLO attainment vs request rate", "request rate R (req/s)",
                                    False, png)

    # A policy measured at one cv so far (a sweep still in pieces) shows as a point beside the others' lines.
    by_cv = _series(lines, "cv", "slo_attainment", ("setting",), min_points=1)
    satisfaction = _series(lines, "cv", "user_satisfaction", ("setting",), min_points=1)
    for (setting,), series in by_cv.items():
        png = out_dir / f"{stem}-cv-{setting}.png"
        panels = [("SLO attainment (first token < 6 s)", "slo_attainment", series)]
        if (setting,) in satisfaction:
            panels.append(("user satisfaction", "user_satisfaction", satisfaction[(setting,)]))
        written[str(png)] = _figure(panels, f"{setting}: SLO attainment vs burstiness, by admission policy",
                                    "arrival cv", True, png, log_base=2)

    png = out_dir / f"{stem}-pool.png"
    pool = plot_pool([x for x in steps_lines if fixed_pool(x) or pool_ran_full(x)],
                     f"{stem}: the pool where memory bound, and what each point did with it", png)
    if pool:
        written[str(png)] = pool

    png = out_dir / f"{stem}-worker-steps.png"
    steps = plot_steps(steps_lines, f"{stem}: where the worker's step time went", png)
    if steps:
        written[str(png)] = steps
    return written


def plot_settings(paths: list[str | Path], out_dir: str | Path | None = None) -> dict[str, dict]:
    """loraplex's throughput and roofline fraction vs number of adapters, a line per setting, over all the
    files: the settings side by side in one figure ({} unless two settings have a curve each)."""
    lines = latest_per_point([x for path in paths for x in read_lines(path)
                              if x["system"] == "loraplex" and not fixed_pool(x)])
    panels = [("throughput (req/s)", "throughput_rps", _series(lines, "n_adapters", "throughput_rps", ()).get((), {})),
              ("fraction of the roofline", "roofline_fraction",
               _series(lines, "n_adapters", "roofline_fraction", ()).get((), {}))]
    if len(panels[0][2]) < 2:
        return {}
    out = Path(out_dir) if out_dir is not None else Path(paths[0]).parent
    png = out / "settings-throughput-vs-adapters.png"
    return {str(png): _figure([p for p in panels if p[2]], "loraplex by setting: throughput vs number of adapters",
                              "adapters (n)", True, png)}


def plot_systems(paths: list[str | Path], out_dir: str | Path | None = None) -> dict[str, dict]:
    """Throughput vs n of every system as shipped on the trace a baseline was measured on (setting, alpha, rate,
    cv, policy), over all the files, one figure per setting, log-scaled throughput ({} without a baseline)."""
    # As shipped only: the server settings tried on some points have their own files' figures.
    lines = latest_per_point([x for path in paths for x in read_lines(path) if not fixed_pool(x) and not x["variant"]])
    trace = ("setting", "alpha", "req_rate", "cv", "policy")
    baseline_traces = {tuple(x[k] for k in trace) for x in lines if x["system"] not in ROOFLINE_SYSTEMS}
    same_trace = [x for x in lines if tuple(x[k] for k in trace) in baseline_traces]
    out = Path(out_dir) if out_dir is not None else Path(paths[0]).parent
    written: dict[str, dict] = {}
    for (setting,), series in _series(same_trace, "n_adapters", "throughput_rps", ("setting",), min_points=1).items():
        if len(series) < 2:
            continue
        png = out / f"systems-throughput-vs-adapters-{setting}.png"
        written[str(png)] = _figure([("throughput (req/s, log)", "throughput_rps", series)],
                                    f"{setting}: every system on one trace, throughput vs number of adapters",
                                    "adapters (n)", True, png, logy=True)
    return written


def plot_all(paths: list[str | Path], out_dir: str | Path | None = None) -> dict[str, dict]:
    """Each file's figures, and the figures across files when the files are every result file of their
    folders: plotting one sweep's file again leaves the figures drawn over all of them as they are."""
    written: dict[str, dict] = {}
    for path in paths:
        written.update(plot_file(path, out_dir))
    if _whole_folders(paths):
        written.update(plot_settings(paths, out_dir))
        written.update(plot_systems(paths, out_dir))
    return written


def _whole_folders(paths: list[str | Path]) -> bool:
    """Whether the files are every result file of the folders they are in."""
    given = {Path(p).resolve() for p in paths}
    return all(f.resolve() in given for folder in {Path(p).parent for p in paths} for f in folder.glob("*.jsonl"))
