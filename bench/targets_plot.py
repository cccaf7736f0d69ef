"""The serving targets as one figure (`loraplex bench targets --plot PNG`): a bar per target, its measured value
as a share of what the target asks (1 = met), and beside it the most the points' own rooflines allow, in
the same share, so a bar short of 1 shows at a glance whether a faster server could close the gap.

The bars are the table's targets (bench/targets.py) read from the same points: S2 n = 2000's throughput over
30 req/s, each ratio over its factor, and each loraplex point's roofline fraction over 0.6. Their limits: the
attainable throughput (every operation at its binding ceiling, `attainable_rps`) for the absolute target and
the roofline fractions, the rooflines' own ratio for a ratio target against another loraplex-shaped system
(PEFT and merge run loraplex's roofline, so their ratios have none).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.targets import (ABSOLUTE, RATIOS, ROOFLINE_TARGET, TARGET_GPU, absolute_name, attainable_share,
                           fraction_points, one_run, ratio_lines, ratio_name, rooflines_ratio, run_points,
                           saturation_points)


@dataclass(frozen=True)
class Score:
    target: str
    share: float  # measured / asked: 1 is met
    limit: float | None  # the most the points' rooflines allow, as the same share
    measured: str  # the measured value, written beside the bar


def scores(paths: list[str | Path], gpu: str = TARGET_GPU) -> list[Score]:
    """Every target measured on `gpu`, in the table's order; a target without its points is left out."""
    points = saturation_points(paths, gpu)
    out = []
    setting, n, rps_asked = ABSOLUTE
    p = points.get((setting, "loraplex", n))
    if p is not None:
        attainable = p.get("attainable_rps") or p.get("roofline_rps")
        out.append(Score(absolute_name(setting, n, rps_asked), p["throughput_rps"] / rps_asked,
                         attainable / rps_asked if attainable else None, f"{p['throughput_rps']:.2f} req/s"))
    by_run = run_points(paths, gpu)
    for setting, num, den, factor, same_run in RATIOS:
        a, b, _ = ratio_lines(points, by_run, setting, num, den, same_run)
        if a is None or b is None:
            continue
        measured = a["throughput_rps"] / b["throughput_rps"]
        limit = rooflines_ratio(a, b)
        runs = " (two runs)" if same_run and not one_run(a, b) else ""  # the target asks for one
        out.append(Score(ratio_name(setting, num, den, factor), measured / factor,
                         limit / factor if limit is not None else None, f"{measured:.2f}×{runs}"))
    for (setting, _, n), p in fraction_points(points):
        fraction, limit = p["roofline_fraction"], attainable_share(p)
        out.append(Score(f"{setting} n = {n} ≥ {ROOFLINE_TARGET:.0%} of the roofline", fraction / ROOFLINE_TARGET,
                         limit / ROOFLINE_TARGET if limit is not None else None, f"{fraction:.2f} of it"))
    return out


def plot_targets(paths: list[str | Path], out: str | Path, gpu: str = TARGET_GPU) -> list[Score]:
    """Draw `scores` to the PNG `out`; returns the bars as drawn (read back from the figure's patches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = scores(paths, gpu)
    if not bars:
        return []
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * len(bars) + 1.6))
    ys = range(len(bars))[::-1]  # the table's order, top to bottom
    # A log scale: PEFT's ratio runs to several times its target while the others sit near 1, and a share
    # half of or twice the target reads as the same distance from it.
    ax.set_xscale("log", base=2)
    left = min([b.share for b in bars] + [0.5]) * 0.8
    drawn = ax.barh(list(ys), [b.share - left for b in bars], left=left, alpha=0.8, height=0.6,
                    color=["C2" if b.share >= 1 else "C3" for b in bars])
    limited = [(y, b.limit) for y, b in zip(ys, bars) if b.limit is not None]
    if limited:
        ax.scatter([lim for _, lim in limited], [y for y, _ in limited], marker="|", s=260, color="black",
                   zorder=3, label="the most its rooflines allow")
    for y, b in zip(ys, bars):
        ax.text(b.share, y, f" {b.measured}", va="center", fontsize=8)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(list(ys), [b.target for b in bars], fontsize=8)
    ax.set_xlabel("measured / asked by the target (1 = met)")
    # Room past the longest bar for the value written beside it.
    right = max([b.share for b in bars] + [lim for _, lim in limited]) * 1.6
    ax.set_xlim(left, right)
    ticks = [t for t in (0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 8, 16) if left <= t <= right]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.grid(True, axis="x", alpha=0.3)
    if limited:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"Serving targets on the {gpu}: each point's latest saturation line")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    # The bars' widths as matplotlib holds them: what the figure shows, not what was asked for.
    return [Score(b.target, float(patch.get_x() + patch.get_width()), b.limit, b.measured)
            for b, patch in zip(bars, drawn)]
