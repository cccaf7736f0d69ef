"""Where the worker's time went, point by point: the `worker_steps` of result lines (over the measured window,
`worker_steps_window`, where a line has them; steps by kind: decode
replayed from CUDA graphs, decode run eagerly, steps carrying prefill) as two panels, each point a row:
the share of step time each kind took, and the mean step of each kind in ms, hatched over the part the host
took to schedule and launch it where the line records that (`launch_ms`): a step launched in nearly all of
its time kept the GPU waiting on the host. Two points of one setting
side by side (loraplex at n = 100 and base-only, say) show whether LoRA's cost is in decode or in prefill.
Where lines record them (`adapter_mb_mean`), a third panel gives the GB of adapter rows a mean step of each
kind read: what grows with the number of adapters served, beside the weights and KV every step reads. A black
tick on a mean step marks its floor where the line has one (`floor_ms`: every operation of the kind's steps at
the ceiling that binds it, bench/step_floor.py).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

KINDS = (("graph", "decode (graph)"), ("decode", "decode (eager)"), ("prefill", "prefill"))


def worker_steps(line: dict) -> dict | None:
    """A line's worker steps over its measured window (`worker_steps_window`, the span its throughput divides
    by: lines from 2026-12-06 on), else over the whole run, its ramp and drain included."""
    return line.get("worker_steps_window") or line.get("worker_steps")


def point_label(line: dict, show_policy: bool = False) -> str:
    """A point's name on the figure; the policy only where it is not the default or the figure mixes them."""
    label = f"{line['setting']} {line['system']}"
    if line["system"] != "base-only":
        label += f" n={line['n_adapters']}"
    for key, short in (("req_rate", "R"), ("cv", "cv")):
        label += f" {short}={line[key]:g}"
    policy = line.get("policy")
    label += f" {policy}" if policy and (show_policy or policy != "early-abort") else ""
    return label + (f" {line['variant']}" if line.get("variant") else "")


def distinct(labels: list[str], rows: list[dict]) -> list[str]:
    """Labels made unique: a point measured in windows of two lengths, or again on another day, keeps a line
    each (matplotlib draws bars of one label in one band, the later over the earlier), told apart by window
    and start time."""
    counts = Counter(labels)
    return [label if counts[label] == 1 else
            f"{label} ({line.get('duration_s', 0):g} s, {str(line.get('started_at', ''))[5:16].replace('T', ' ')})"
            for label, line in zip(labels, rows)]


def plot_steps(lines: list[dict], title: str, path: Path) -> dict:
    """The figure of every line with `worker_steps`, to `path`; {panel: {kind: [(point label, value)]}} as
    drawn, or {} (and no file) when no line has them."""
    rows = [line for line in lines if worker_steps(line)]
    if not rows:
        return {}
    steps = [worker_steps(line) for line in rows]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = len({line.get("policy") for line in rows}) > 1
    labels = distinct([point_label(line, show_policy=mixed) for line in rows], rows)
    fig_height = 2.0 + 0.45 * len(rows)  # inches: title, axis labels and legend, then a band per point
    with_rows = any(s.get("adapter_mb_mean") is not None for by_kind in steps for s in by_kind.values())
    label_width = 0.075 * max(len(label) for label in labels)  # inches, at the tick labels' size
    fig, axes = plt.subplots(1, 2 + with_rows, figsize=(10 + 4 * with_rows + label_width, fig_height), squeeze=True)
    share_ax, mean_ax = axes[:2]
    drawn: dict[str, dict] = {"share": {}, "mean_ms": {}, "launch_ms": {}}
    left = [0.0] * len(rows)
    bar = 0.8 / len(KINDS)  # a point's band holds one bar per kind
    for i, (kind, name) in enumerate(KINDS):
        shares = [s[kind]["share"] or 0.0 for s in steps]
        share_ax.barh(labels, shares, left=left, label=name, color=f"C{i}")
        left = [a + b for a, b in zip(left, shares)]
        drawn["share"][kind] = list(zip(labels, shares))
        means = [s[kind]["mean_ms"] or 0.0 for s in steps]
        mean_ax.barh([y + (i - 1) * bar for y in range(len(rows))], means, height=bar, label=name,
                     color=f"C{i}")
        drawn["mean_ms"][kind] = list(zip(labels, means))
        floors = [(y, s[kind].get("floor_ms")) for y, s in enumerate(steps)]
        floors = [(y, ms) for y, ms in floors if ms]
        if floors:
            mean_ax.scatter([ms for _, ms in floors], [y + (i - 1) * bar for y, _ in floors], marker="|", s=160,
                            color="black", zorder=3, label="floor" if "floor_ms" not in drawn else None)
            drawn.setdefault("floor_ms", {})[kind] = [(labels[y], ms) for y, ms in floors]
        launches = [(y, s[kind].get("launch_ms")) for y, s in enumerate(steps)]
        launches = [(y, ms) for y, ms in launches if ms is not None]
        if launches:
            mean_ax.barh([y + (i - 1) * bar for y, _ in launches], [ms for _, ms in launches], height=bar,
                         color="none", edgecolor="black", hatch="//", linewidth=0.5,
                         label="launched by the host" if not drawn["launch_ms"] else None)
            drawn["launch_ms"][kind] = [(labels[y], ms) for y, ms in launches]
        if with_rows:
            gb = [(s[kind].get("adapter_mb_mean") or 0.0) / 1e3 for s in steps]
            axes[2].barh([y + (i - 1) * bar for y in range(len(rows))], gb, height=bar, color=f"C{i}")
            drawn.setdefault("adapter_gb", {})[kind] = list(zip(labels, gb))
    share_ax.set_xlim(0, 1)
    share_ax.set_xlabel("share of the worker's step time")
    blank = [""] * len(rows)  # the rows are named once, on the left panel, which the figure widens to hold them
    mean_ax.set_yticks(range(len(rows)), blank)
    mean_ax.set_xlabel("mean step (ms)")
    if with_rows:
        axes[2].set_yticks(range(len(rows)), blank)
        axes[2].set_xlabel("adapter rows a mean step read (GB)")
    marks = bool(drawn["launch_ms"]) + bool(drawn.get("floor_ms"))  # legend entries only the mean panel has
    legend_ax = mean_ax if marks else share_ax
    save_rows_figure(fig, tuple(axes), legend_ax, len(KINDS) + marks, title, fig_height, path)
    return drawn


def save_rows_figure(fig, axes, legend_ax, legend_columns: int, title: str, fig_height: float, path: Path) -> None:
    """Finish a figure of one row per point across `axes` (the file's order, top to bottom), with one legend
    (`legend_ax`'s) below every panel, clear of the bars, and write it to `path`."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*legend_ax.get_legend_handles_labels(), loc="lower center", ncol=legend_columns, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.35 / fig_height)  # room for the legend
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
