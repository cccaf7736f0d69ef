"""What each point did with a pool where memory bound: one the sweep sized (bench/sweeps/s2-memory.yaml: the
unified pool against fixed KV and adapter parts), or a whole GPU's that ran short (an 80 GB card at S2 n = 2000):
the peak slots its KV cache and its adapters took, against the pool, beside the running batch's peak, the
requests preempted for KV space (each recomputed later) and the throughput it served. Peaks of the two kinds
need not coincide, so they are drawn side by side, not stacked.
"""
from __future__ import annotations

from pathlib import Path

from bench.plot_steps import distinct, point_label, save_rows_figure

USES = (("pool_kv_slots_peak", "KV cache, peak"), ("pool_adapter_slots_peak", "adapters, peak"))
RESULTS = (("running_requests_peak", "running requests, peak"), ("preemptions", "requests preempted"),
           ("throughput_rps", "throughput (req/s)"))


def plot_pool(lines: list[dict], title: str, path: Path) -> dict:
    """The figure of every line with a pool size and its peaks, to `path`; {panel: {series: [(point label,
    value)]}} as drawn, or {} (and no file) when no line has them."""
    rows = [x for x in lines if x.get("pool_total_slots") and all(x.get(k) is not None for k, _ in USES)]
    if not rows:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = distinct([point_label(x) for x in rows], rows)
    fig_height = 2.2 + 0.6 * len(rows)  # inches: title, axis labels and legend, then a band per point
    fig, axes = plt.subplots(1, 1 + len(RESULTS), figsize=(15, fig_height), squeeze=True,
                             gridspec_kw={"width_ratios": [2] + [1] * len(RESULTS)})
    drawn: dict[str, dict] = {"slots": {}}
    bar = 0.8 / len(USES)
    slots_ax = axes[0]
    for i, (key, name) in enumerate(USES):
        values = [float(x[key]) for x in rows]
        slots_ax.barh([y + (i - 0.5) * bar for y in range(len(rows))], values, height=bar, label=name, color=f"C{i}")
        drawn["slots"][name] = list(zip(labels, values))
    totals = [float(x["pool_total_slots"]) for x in rows]
    for y, total in enumerate(totals):  # each point's pool as a bracket across its band
        slots_ax.plot([total, total], [y - 0.45, y + 0.45], color="black", linewidth=2,
                      label="pool" if y == 0 else None)
    drawn["slots"]["pool"] = list(zip(labels, totals))
    slots_ax.set_yticks(range(len(rows)), labels)
    slots_ax.set_xlabel("slots (thousands)")
    slots_ax.xaxis.set_major_formatter(lambda value, _: f"{value / 1e3:g}")  # 120000 and its neighbours collide
    for ax, (key, name) in zip(axes[1:], RESULTS):
        values = [float(x.get(key) or 0.0) for x in rows]
        ax.barh(range(len(rows)), values, color="C2" if key == "throughput_rps" else "C4")
        ax.set_yticks(range(len(rows)), [""] * len(rows))
        ax.set_xlabel(name)
        # Counts start at zero; a panel of zeros (a pool that ran full and preempted nobody) keeps a 0..1 axis
        # instead of matplotlib's symmetric ticks around 0.
        ax.set_xlim(0, max(values) * 1.05 if max(values) > 0 else 1)
        drawn[key] = list(zip(labels, values))
    save_rows_figure(fig, axes, slots_ax, len(USES) + 1, title, fig_height, path)
    return drawn
