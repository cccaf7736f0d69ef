"""The worker.kernel_shapes value the kernel runs favour for one served shape, so a served point can try it in the
same GPU session: the fastest served decode attention shape (gpu_proof's attention_served, in a pool of a
served size), a mixed step's decode rows apart (attention_mixed) and expand's column-tile order
(graph_live_segments --plans shapes), each only where it beat the kernels' own choice by `--min-gain`.

    python -m benchmarks.kernels.pick_shapes --proof out/kernels.json --graph gls384_shapes.json --batch 384

Prints the value on stdout (empty when nothing won) and why on stderr; with --slot-run, the worker.kv_slot_run
whose pool layout the served rows read fastest (1 unless runs of slots won).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.kernels.report import variant_times


def served_attention(rows: list[dict], model: str, batch: int, min_gain: float) -> tuple[str, str]:
    """The fastest kernel_shapes value on `batch` sequences of `model` over single-token pages in the largest
    pool measured, if it beat the chosen launch by min_gain."""
    rows = [r for r in rows if r["model"] == model and r["batch"] == batch and r.get("slot_run", 1) == 1]
    if not rows:
        return "", f"attention: no served row for {model} at batch {batch}"
    row = max(rows, key=lambda r: r.get("pool_slots", 0))
    timed = variant_times(row)
    if not timed:
        return "", "attention: no shape timed"
    words, best = min(timed.items(), key=lambda kv: kv[1])
    why = f"attention at batch {batch}: {words} {best:.1f} us against {row['ours_us']:.1f}"
    return (words, why) if best <= (1 - min_gain) * row["ours_us"] else ("", why + ": kept")


def slot_run(rows: list[dict], model: str, batch: int, min_gain: float) -> tuple[int, str]:
    """The worker.kv_slot_run whose layout the served rows read fastest with the chosen launch: runs of
    consecutive slots against single-token pages, both in the largest pool measured."""
    rows = [r for r in rows if r["model"] == model and r["batch"] == batch]
    if not rows:
        return 1, f"slot runs: no served row for {model} at batch {batch}"
    pool = max(r.get("pool_slots", 0) for r in rows)
    by_run = {r.get("slot_run", 1): r["ours_us"] for r in rows if r.get("pool_slots", 0) == pool}
    if 1 not in by_run or len(by_run) < 2:
        return 1, "slot runs: no layouts to compare"
    run, best = min(by_run.items(), key=lambda kv: kv[1])
    why = f"slot runs at batch {batch}: runs of {run} {best:.1f} us against single slots {by_run[1]:.1f}"
    return (run, why) if best <= (1 - min_gain) * by_run[1] else (1, why + ": kept")


def mixed_apart(rows: list[dict], model: str, min_gain: float) -> tuple[str, str]:
    rows = [r for r in rows if r["model"] == model]
    if not rows:
        return "", f"mixed steps: no row for {model}"
    ratio = sum(r["decode_apart_us"] / r["one_launch_us"] for r in rows) / len(rows)
    why = f"mixed steps: decode rows apart take {ratio:.3f} of one launch's time"
    # Apart is the default (kernel_shapes' split_mixed): one launch is asked for only where it wins.
    return ("no_split_mixed", why) if ratio * (1 - min_gain) >= 1 else ("", why + ": kept")


def expand_order(rows: list[dict], batch: int, min_gain: float) -> tuple[str, str]:
    """Expand in column-tile order against the chosen order, summed over the groups at the most adapters."""
    rows = [r for r in rows if r["batch"] == batch and r["plan"] in ("bound", "bound cf")]
    if not rows:
        return "", f"expand: no graph rows at batch {batch}"
    most = max(r["distinct_adapters"] for r in rows)
    cost = {plan: sum(r["expand_us"] for r in rows if r["plan"] == plan and r["distinct_adapters"] == most)
            for plan in ("bound", "bound cf")}
    why = f"expand at batch {batch}, {most} adapters: column tile first {cost['bound cf']:.1f} us against {cost['bound']:.1f}"
    return ("expand_cols_first", why) if cost["bound cf"] <= (1 - min_gain) * cost["bound"] else ("", why + ": kept")


def pick(proof: dict, graph_rows: list[dict], model: str, batch: int, min_gain: float) -> tuple[str, list[str]]:
    choices = [served_attention(proof.get("attention_served", []), model, batch, min_gain),
               mixed_apart(proof.get("attention_mixed", []), model, min_gain)]
    if graph_rows:
        choices.append(expand_order(graph_rows, batch, min_gain))
    words = ",".join(w for w, _ in choices if w)
    return words, [why for _, why in choices]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proof", type=Path, required=True, help="gpu_proof's kernels.json")
    ap.add_argument("--graph", type=Path, help="graph_live_segments --plans shapes output")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--min-gain", type=float, default=0.03, help="fraction of the time a shape must save")
    ap.add_argument("--slot-run", action="store_true",
                    help="print the worker.kv_slot_run value the served rows favour instead")
    args = ap.parse_args(argv)
    proof = json.loads(args.proof.read_text())
    if args.slot_run:
        run, why = slot_run(proof.get("attention_served", []), args.model, args.batch, args.min_gain)
        print(why, file=sys.stderr)
        print(run)
        return 0
    graph_rows = []
    if args.graph is not None and args.graph.exists():
        data = json.loads(args.graph.read_text())
        graph_rows = data["rows"] if isinstance(data, dict) else data
    words, reasons = pick(proof, graph_rows, args.model, args.batch, args.min_gain)
    for why in reasons:
        print(why, file=sys.stderr)
    print(words)
    return 0


if __name__ == "__main__":
    sys.exit(main())
