"""Plot decode step time per batch size, base only vs with adapters, from engine_decode.py's JSON.

    python benchmarks/plot_engine.py docs/results/engine_decode.json docs/engine_decode.png
"""
from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.load(open(src))["results"] if r["graphs"]]
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.38
    for k, mode in enumerate(("base", "lora")):
        times = [next(r["step_ms"] for r in rows if r["batch"] == b and r["mode"] == mode) for b in batches]
        xs = [i + (k - 0.5) * width for i in range(len(batches))]
        label = "base model only" if mode == "base" else "100 distinct adapters, ranks 8-64"
        bars = ax.bar(xs, times, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title("Llama-2-7B shapes, bf16, H200, CUDA graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
