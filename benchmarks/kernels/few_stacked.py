"""A decode graph's LoRA over a few adapters: the segment kernels as the few-adapter graphs launch them, against
the same work as dense products (ops.stacked_lora: the adapters' rows gathered side by side, one shrink GEMM,
one expand GEMM a module).

Each row is one (model, group, batch, adapters in the batch, plan), microseconds a layer call timed in CUDA
graphs that cycle over several layers' buffers, and how far the plan's LoRA output lies from the kernels' exact
plan (an eager step's launch, which the kernel tests check against the reference). Plans:
  kernels        shrink + expand as a few-adapter graph launches them (graph_live_segments' "bound live 32 p32":
                 the engine's cuda_graph_few_adapters and cuda_graph_segment_programs, 32 each)
  stacked        the rows gathered from the pool, then the products; columns: the adapters' ranks summed
  stacked cN     the same over N columns (a graph planned for any few adapters pads to its most)
  stacked rows   the products alone, the rows gathered once before timing (what caching the stack would give)

    python -m benchmarks.kernels.few_stacked --out few_stacked.json --plot few_stacked.png
    python -m benchmarks.kernels.few_stacked --smoke --out /tmp/x.json   # CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from benchmarks.kernels.graph_live_segments import RESULT_TOLERANCE, batch_of, measure
from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config
from benchmarks.kernels.timing import time_graph
from services.gpu_worker import kernels
from services.gpu_worker.ops.stacked_lora import (gather_stack, stack_mask, stack_rows, stacked_lora,
                                                  stacked_positions, stacked_products)

KERNEL_PLAN = "bound live 32 p32"
SETTINGS = (("llama3-8b", 512), ("llama2-7b", 384))  # S-GQA's and S2's running batches


def stacked_rows(model: str, group: str, batch: int, distinct: int, paddings: tuple[int, ...], n_adapters: int = 256,
                 num_layers: int = 8, dtype=torch.bfloat16, device: str = "cuda", seed: int = 0) -> list[dict]:
    """The stacked plans' rows for `batch` tokens over `distinct` adapters (graph_live_segments.batch_of)."""
    cfg = llama_config(model)
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(n_adapters)]
    pool = AdapterPool(cfg, ranks, dtype, device, num_layers=num_layers, spare_slots=1, seed=seed)
    zero = int(pool.spare[0])
    pool.kv[:, :, zero] = 0
    gen = torch.Generator().manual_seed(seed + batch + distinct)
    token_adapter = batch_of(distinct, batch, n_adapters, gen).to(device)
    x = torch.randn(batch, fan_in, generator=gen).to(device, dtype)
    out = torch.randn(batch, sum(out_dims), generator=gen).to(device, dtype)
    adapters = sorted(a for a in torch.unique(token_adapter).tolist() if a >= 0)
    positions = stacked_positions(token_adapter, adapters)

    # The kernels' exact plan on this pool: what every stacked plan's output is held to.
    exact = kernels.group_tokens_by_adapter(token_adapter, num_distinct=distinct, count_live=True)
    runs = [n for n in torch.bincount(token_adapter.long() + 1).tolist() if n]
    hints = {**exact.kwargs(), "max_seg_len": max(runs)}
    hints.pop("chunk_items", None)
    y0 = kernels.lora_shrink(x, pool.k(0), token_adapter, pool.tables, modules, 64, **hints)
    reference = torch.zeros_like(out)
    kernels.lora_expand(y0, pool.v(0), token_adapter, pool.tables, modules, reference, out_dims, **hints)
    scale = reference.float().abs().max().item() or 1.0

    need = stack_rows(pool.tables, adapters, modules, fan_in, out_dims, pool.width, zero).columns
    rows = []
    for columns in (need, *(c for c in paddings if c > need)):
        stack = stack_rows(pool.tables, adapters, modules, fan_in, out_dims, pool.width, zero, columns, device)
        checked = torch.zeros_like(out)
        stacked_lora(x, pool.k(0), pool.v(0), stack_mask(positions, stack.owner, dtype), stack, checked)
        diff = (checked.float() - reference.float()).abs().max().item() / scale

        def both():
            # The mask is made once a step for every layer and group (model.forward); here once a layer call.
            keep = stack_mask(positions, stack.owner, dtype)
            for layer in range(num_layers):
                stacked_lora(x, pool.k(layer), pool.v(layer), keep, stack, out)

        plan = "stacked" if columns == need else f"stacked c{columns}"
        rows.append(_row(model, group, batch, distinct, plan, columns, time_graph(both) / num_layers * 1e3, diff))
        if columns == need:
            us, products_diff = _time_products(x, pool, positions, stack, out, num_layers, reference, scale)
            rows.append(_row(model, group, batch, distinct, "stacked rows", columns, us, products_diff))
    return rows


def _time_products(x, pool: AdapterPool, positions, stack, out, num_layers: int, reference, scale) -> tuple[float, float]:
    """Microseconds a layer of the products alone, each layer's rows gathered into dense stacks beforehand, and
    their output's distance from the kernels' exact plan."""
    dense = [gather_stack(pool.k(layer), pool.v(layer), stack) for layer in range(num_layers)]
    keep = stack_mask(positions, stack.owner, x.dtype)

    def products(target, layers):
        for a, bts in layers:
            stacked_products(x, a, bts, keep, target)

    checked = torch.zeros_like(out)
    products(checked, dense[:1])
    diff = (checked.float() - reference.float()).abs().max().item() / scale
    return time_graph(lambda: products(out, dense)) / num_layers * 1e3, diff


def _row(model, group, batch, distinct, plan, columns, us, diff) -> dict:
    return {"model": model, "group": group, "batch": batch, "distinct_adapters": distinct, "plan": plan,
            "columns": columns, "us": us, "max_rel_diff_vs_exact": diff}


def kernel_rows(model: str, group: str, batch: int, distinct: int, device: str, num_layers: int) -> list[dict]:
    rows = measure(model, group, batch, distinct, plans=(KERNEL_PLAN, "exact"), device=device, num_layers=num_layers)
    return [_row(model, group, batch, distinct, "kernels" if r["plan"] == KERNEL_PLAN else "kernels exact", 0,
                 r["both_us"], r["max_rel_diff_vs_exact"]) | {"shrink_us": r["shrink_us"], "expand_us": r["expand_us"]}
            for r in rows]


def write_rows(path: str, rows: list[dict], device: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


PLOTTED = ("kernels", "stacked", "stacked rows")


def plot_rows(rows: list[dict], path: str) -> None:
    """Bars of a layer call's microseconds, one panel per model and batch: each group over each adapter count,
    the kernels beside the stacked products with and without the gather."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(7 * len(settings), 4.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], settings):
        mine = [r for r in rows if (r["model"], r["batch"]) == (model, batch)]
        cells = sorted({(r["group"], r["distinct_adapters"]) for r in mine}, key=lambda c: (c[0], c[1]))
        us = {(r["group"], r["distinct_adapters"], r["plan"]): r["us"] for r in mine}
        for i, plan in enumerate(PLOTTED):
            ax.bar([j + (i - 1) * 0.27 for j in range(len(cells))], [us.get((*c, plan), float("nan")) for c in cells],
                   width=0.27, label=plan)
        ax.set_xticks(range(len(cells)), [f"{g}\n{n}" for g, n in cells], fontsize=8)
        ax.set_xlabel("module group, adapters in the batch")
        ax.set_ylabel("µs a layer call")
        ax.set_title(f"LoRA over a few adapters, {model}, batch {batch}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distinct", default="2,5,8", help="adapters in the batch, comma-separated")
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--paddings", default="256,512", help="column counts of the padded stacked plans")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="a PNG of the rows' times")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script runs")
    args = p.parse_args()
    settings, device, layers = SETTINGS, "cuda", 8
    if args.smoke:
        settings, device, layers = (("tiny", 16),), "cpu", 2
    distinct = [int(d) for d in args.distinct.split(",")]
    paddings = tuple(int(c) for c in args.paddings.split(","))
    rows = []
    combos = [(m, b, g, d) for m, b in settings for g in args.groups.split(",") for d in distinct]
    for i, (model, batch, group, n) in enumerate(combos):
        found = kernel_rows(model, group, batch, n, device, layers)
        found += stacked_rows(model, group, batch, n, paddings, num_layers=layers, device=device,
                              dtype=torch.float32 if args.smoke else torch.bfloat16)
        rows += found
        write_rows(args.out, rows, device)  # after every combination: a run cut short keeps what it measured
        kernel_us = found[0]["us"]
        print(f"[{i + 1}/{len(combos)}] {model} {group} batch {batch} over {n}: "
              + ", ".join(f"{r['plan']} {r['us']:.1f} µs" for r in found)
              + (f" (stacked / kernels {found[2]['us'] / kernel_us:.2f})" if not math.isnan(kernel_us) else ""),
              file=sys.stderr, flush=True)
    if args.plot:
        plot_rows(rows, args.plot)
    bad = [r for r in rows if r["max_rel_diff_vs_exact"] > RESULT_TOLERANCE]
    for r in bad:
        print(f"MISMATCH {r['model']} {r['group']} over {r['distinct_adapters']} {r['plan']}: "
              f"{r['max_rel_diff_vs_exact']:.3g} of the output's largest", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
