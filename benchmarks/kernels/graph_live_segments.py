"""LoRA shrink + expand as a decode graph launches them: one segment per token, since the graph cannot know
the step's adapters, with the launch planned for a few busy segments and the segments shared out among
fewer programs (the engine's cuda_graph_few_adapters and cuda_graph_segment_programs), with 64-token tiles, against
the plan for all of them and the plan of an eager step that knows the exact distinct count (PLANS); or, with
--plans shapes, shrink's and expand's launch shapes against the ones the kernels choose (SHAPE_PLANS).

Each row is one (group, batch, adapters in the batch, plan): microseconds per layer call of shrink (with its
split-K finalize) and expand, times captured in CUDA graphs that cycle over several layers' buffers, and
how far the plan's LoRA output lies from the exact plan's (an eager step's launch, which the kernel tests
check against the reference): a plan only reshapes the launch, so a gap beyond bf16 rounding fails the run.

    python -m benchmarks.kernels.graph_live_segments --out graph_live_segments.json
    python -m benchmarks.kernels.graph_live_segments --plans shapes --distinct 5,100 --out shapes.json
    python -m benchmarks.kernels.graph_live_segments --smoke --out /tmp/x.json   # CPU interpreter
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict

import torch

from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config
from benchmarks.kernels.timing import time_graph
from services.gpu_worker import kernels
from services.gpu_worker.kernels.lora_expand import choose_expand_config
from services.gpu_worker.kernels.lora_groups import chunk_count
from services.gpu_worker.kernels.lora_shrink import GRAPH_FEW_SHRINK_LONG_M, choose_shrink_config

# A plan: which segments are launched ("bound": one per token, as a graph launches them, or "exact": the
# distinct count an eager step knows) and how the launch is shaped: "live N" plans it for N busy segments,
# "m64" uses 64-token tiles (a segment of a few dozen tokens in one tile, not a loop of 16-token ones),
# "pN" shares the segments out among N programs (no empty ones for unused segments). "exact live 16"
# launches the exact segments with the 16-segment plan's shapes: "bound live 16" minus it is what the
# graph's empty segment programs cost. "ci" (exact plans) launches one program per chunk of a long segment
# that holds tokens, from the step's chunk list, as the engine's eager steps do (lora_groups.ChunkItems);
# without it every segment gets the longest one's chunk count.
# Each kernel's launch shape can be changed on its own. Expand: "cf" programs in column-tile order, "emN" N-row
# tiles, "nN" N-column tiles, "rN" N rank rows a dot, "wN" N warps, "sN" N pipeline stages, "tN" N column tiles
# walked by one program, "rw" the whole rank in one dot (with r64: every rank up to 64), the program's column
# tiles its inner loop, "ed" the busy segments' token tiles dealt to the programs in turn (with pN), "gN" at most
# N registers a thread (more programs a multiprocessor, or spills). Shrink:
# "skN" N-input tiles, "sxN" the inputs split N ways, "srN" N rank columns a dot, "swN" N warps, "ssN" N
# pipeline stages, "smN" N-token tiles, "slN" segments of more than N tokens in GRAPH_FEW_SHRINK_LONG_M-token
# tiles (programs sharing segments out only; by default from 16, "sl0": one height), "sd" its tiles dealt as
# expand's with "ed", "sgN" at most N registers a thread. "scN" and "ecN" give
# shrink's and expand's programs N tokens of a segment each (its chunks spread over the grid's second axis; with
# shared programs, each program takes the same chunk of every segment it walks).
# Largest LoRA output difference from the exact plan, relative to the output's largest magnitude: plans sum
# the inputs in other splits and orders, so bf16 results differ by rounding only.
RESULT_TOLERANCE = 2e-2
PLANS = ("bound", "bound live 4", "bound live 8", "bound live 16", "bound live 32", "bound live 64",
         "bound live 16 m64", "bound live 16 p16", "bound live 16 p32", "bound live 16 p64", "bound live 32 p32",
         "exact live 16", "exact")
# Launch shapes tried against the default choice (--plans shapes); the graph's launch first (most of decode; the
# "p128" ones share a many-adapter step's segments among 128 programs), then an eager step's exact segments.
SHAPE_PLANS = ("bound", "bound t1", "bound r16", "bound t4", "bound w2", "bound r16 w2", "bound n64", "bound n64 t4",
               "bound sw8", "bound sw2", "bound sk64", "bound sk256", "bound sx2", "bound sr16", "bound ss1",
               "bound ss3", "bound live 128 p128 t2", "bound live 256 p128 t2", "bound cf", "bound cf t1",
               "bound cf t4", "bound cf n64 t4", "bound t8", "bound t32", "bound cf t8", "exact", "exact t2",
               "exact r16 t2", "exact sw8", "exact cf", "exact cf t2",
               # Wider column tiles, and the whole rank a step with the column tiles pipelined (added 2026-12-04
               # after gate,up's expand read at ~1.7 TB/s in S-GQA's decode graphs).
               "bound n256", "bound n256 t2", "bound rw r64 t4", "bound rw r64 t8", "bound rw r64 t4 s3",
               "bound rw r64 n256 t2", "bound rw r64 t4 w8", "exact rw r64 t2", "exact rw r64 t4")
EXPAND_WORDS = {"n": "block_n", "r": "block_r", "w": "num_warps", "s": "num_stages", "t": "tiles_per_prog",
                "g": "max_registers"}
SHRINK_WORDS = {"sk": "block_k", "sx": "n_split", "sr": "block_r", "sw": "num_warps", "ss": "num_stages",
                "sm": "block_m", "sc": "chunk_tokens", "sg": "max_registers"}


@dataclasses.dataclass(frozen=True)
class Plan:
    exact: bool
    live: int | None = None
    block_m: int | None = None
    programs: int = 0
    chunk_items: bool = False
    expand: tuple = ()  # (ExpandConfig field, value) pairs
    shrink: tuple = ()  # (ShrinkConfig field, value) pairs

    @classmethod
    def parse(cls, text: str) -> "Plan":
        words = text.split()
        if not words or words[0] not in ("bound", "exact"):
            raise ValueError(f"plan {text!r} must start with bound or exact")
        fields = {"exact": words[0] == "exact"}
        rest = iter(words[1:])
        for word in rest:
            if word == "live":
                fields["live"] = int(next(rest))
            elif word.startswith("m"):
                fields["block_m"] = int(word[1:])
            elif word.startswith("p"):
                fields["programs"] = int(word[1:])
            elif word == "ci":
                fields["chunk_items"] = True
            elif word == "cf":  # expand's programs in column-tile order
                fields["expand"] = fields.get("expand", ()) + (("cols_first", True),)
            elif word == "rw":  # expand's whole rank in one step, its column tiles the inner loop
                fields["expand"] = fields.get("expand", ()) + (("rank_whole", True),)
            elif word == "ed":  # expand's token tiles dealt to its programs in turn (shared programs only)
                fields["expand"] = fields.get("expand", ()) + (("deal_tiles", True), ("chunk_tokens", 0))
            elif word == "sd":  # shrink's, likewise
                fields["shrink"] = fields.get("shrink", ()) + (("deal_tiles", True), ("chunk_tokens", 0))
            elif word[:2] == "em" and word[2:].isdigit():  # expand's row tiles alone ("mN" sets both kernels')
                fields["expand"] = fields.get("expand", ()) + (("block_m", int(word[2:])),)
            elif word[:2] == "ec" and word[2:].isdigit():  # expand's tokens a program (a segment's chunks)
                fields["expand"] = fields.get("expand", ()) + (("chunk_tokens", int(word[2:])),)
            elif word[:2] == "sl" and word[2:].isdigit():  # shrink's tile height chosen per segment; sl0: one
                long_from = int(word[2:])
                fields["shrink"] = fields.get("shrink", ()) + (
                    ("block_m_long", GRAPH_FEW_SHRINK_LONG_M if long_from else 0), ("long_from", long_from))
            elif word[:2] in SHRINK_WORDS and word[2:].isdigit():
                fields["shrink"] = fields.get("shrink", ()) + ((SHRINK_WORDS[word[:2]], int(word[2:])),)
            elif word[:1] in EXPAND_WORDS and word[1:].isdigit():
                fields["expand"] = fields.get("expand", ()) + ((EXPAND_WORDS[word[0]], int(word[1:])),)
            else:
                raise ValueError(f"plan {text!r}: unknown word {word!r}")
        return cls(**fields)


def batch_of(distinct: int, batch: int, n_adapters: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` tokens spread over `distinct` adapters (each at least once), shuffled as a decode batch is."""
    chosen = torch.randperm(n_adapters, generator=gen)[:distinct].to(torch.int32)
    ids = chosen[torch.arange(batch) % distinct]
    return ids[torch.randperm(batch, generator=gen)].contiguous()


def measure(model: str, group: str, batch: int, distinct: int, plans=PLANS, n_adapters: int = 256,
            num_layers: int = 8, dtype=torch.bfloat16, device: str = "cuda", seed: int = 0,
            token_adapter: torch.Tensor | None = None) -> list[dict]:
    """Rows of `plans` for `batch` tokens over `distinct` adapters (batch_of), or for the given `token_adapter`
    (adapter ids below n_adapters; `batch` and `distinct` then only label the rows)."""
    cfg = llama_config(model)
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(n_adapters)]
    pool = AdapterPool(cfg, ranks, dtype, device, num_layers=num_layers, seed=seed)
    gen = torch.Generator().manual_seed(seed + batch + distinct)
    if token_adapter is None:
        token_adapter = batch_of(distinct, batch, n_adapters, gen)
    if token_adapter.shape[0] != batch:
        raise ValueError(f"token_adapter has {token_adapter.shape[0]} tokens, batch says {batch}")
    token_adapter = token_adapter.to(device)
    x = torch.randn(batch, fan_in, generator=gen).to(device, dtype)
    out = torch.randn(batch, sum(out_dims), generator=gen).to(device, dtype)
    max_rank = 64  # a decode graph's rank bucket for mixed ranks up to 64
    bound = kernels.group_tokens_by_adapter(token_adapter, count_live=True)  # a segment per token, as in a graph
    # An eager step knows its segments: their count, the longest (prefill runs are split into chunks by it)
    # and the chunks that hold tokens; a graph's launch knows none of them.
    runs = [n for n in torch.bincount(token_adapter.long() + 1).tolist() if n]
    longest_run = max(runs)
    exact = kernels.group_tokens_by_adapter(token_adapter, num_distinct=distinct, count_live=True,
                                            num_chunks=chunk_count(runs))
    # Only a GPU times the plans; the CPU interpreter (smoke runs) would just run each kernel twice more.
    timed = torch.device(device).type == "cuda"
    rows, deltas = [], {}
    for text in plans:
        plan = Plan.parse(text)
        groups = exact if plan.exact else bound
        longest = longest_run if plan.exact else None
        hints = {**groups.kwargs(), "live_segments": plan.live, "max_seg_len": longest}
        if not plan.programs:
            hints.pop("num_live")  # one program per segment, as the engine launches them by default
        if not plan.chunk_items:
            hints.pop("chunk_items", None)  # every segment gets the longest one's chunk count
        segments = groups.seg_adapter.shape[0]
        # "exact live N" keeps the bound's launch shapes (split, tiles), only without its empty segments.
        # (Its shapes are chosen as the bound's are, knowing no segment length: a decode batch's segments are
        # short enough that the launch cuts none into chunks either way.)
        shaped_as_bound = plan.exact and plan.live
        planned_for = bound.seg_adapter.shape[0] if shaped_as_bound else segments
        planned_len = None if shaped_as_bound else longest
        listed = hints.get("chunk_items")  # the engine plans its split for the chunks a step lists
        cfg_s = choose_shrink_config(batch, len(modules), fan_in, pool.width, max_rank, x.device, True, planned_len,
                                     planned_for, plan.live, plan.programs, listed.count if listed else None)
        cfg_e = choose_expand_config(batch, len(modules), out_dims, pool.width, max_rank, x.device, True, planned_len,
                                     planned_for, plan.live, plan.programs)
        if plan.block_m:
            cfg_s = dataclasses.replace(cfg_s, block_m=plan.block_m)
            cfg_e = dataclasses.replace(cfg_e, block_m=plan.block_m)
        if plan.expand:
            cfg_e = dataclasses.replace(cfg_e, **dict(plan.expand))
        if plan.shrink:
            cfg_s = dataclasses.replace(cfg_s, **dict(plan.shrink))
        y = {}

        def shrink():
            for layer in range(num_layers):
                y["y"] = kernels.lora_shrink(x, pool.k(layer), token_adapter, pool.tables, modules, max_rank,
                                             config=cfg_s, **hints)

        def expand():
            for layer in range(num_layers):
                kernels.lora_expand(y["y"], pool.v(layer), token_adapter, pool.tables, modules, out, out_dims,
                                    config=cfg_e, **hints)

        # One layer's LoRA output under this plan, for the comparison across plans: added to zeros, not to `out`,
        # which the timed replays keep adding to (its growing magnitude would swamp the LoRA term in bf16); an
        # output row a plan leaves unwritten stays 0 and shows against the exact plan's.
        y0 = kernels.lora_shrink(x, pool.k(0), token_adapter, pool.tables, modules, max_rank, config=cfg_s, **hints)
        checked = torch.zeros_like(out)
        kernels.lora_expand(y0, pool.v(0), token_adapter, pool.tables, modules, checked, out_dims, config=cfg_e,
                            **hints)
        deltas[text] = checked.float()
        if timed:
            shrink()  # expand's input, before expand is timed
        row = {"model": model, "group": group, "batch": batch, "distinct_adapters": distinct, "plan": text,
               "segments": segments, "chunk_items": groups.chunk_items.count if plan.chunk_items else 0,
               "n_split": cfg_s.n_split, "block_m": cfg_s.block_m,
               "expand_block_n": cfg_e.block_n, "segment_programs": plan.programs, "expand": dataclasses.asdict(cfg_e),
               "shrink": dataclasses.asdict(cfg_s),
               "shrink_us": time_graph(shrink) / num_layers * 1e3 if timed else float("nan"),
               "expand_us": time_graph(expand) / num_layers * 1e3 if timed else float("nan"),
               "adapter_bytes": pool.adapter_bytes(token_adapter, fan_in, out_dims)}
        row["both_us"] = row["shrink_us"] + row["expand_us"]
        rows.append(row)
    reference = deltas.get("exact", deltas[plans[-1]])
    scale = reference.abs().max().item() or 1.0
    for row in rows:
        row["max_rel_diff_vs_exact"] = (deltas[row["plan"]] - reference).abs().max().item() / scale
    return rows


def rank_graph_plans(rows: list[dict]) -> list[dict]:
    """The plans a graph can use (those launching the bound), best first: for each batch and adapter count,
    a plan's time summed over the groups (a layer's LoRA work), over the best such plan's; ranked by the mean
    of that ratio over the counts, the worst ratio beside it. Rows without a time (no GPU) are left out."""
    cost: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        if r["plan"].startswith("bound") and r["both_us"] == r["both_us"]:  # NaN without a GPU
            cost[r["plan"]][r["batch"], r["distinct_adapters"]] += r["both_us"]
    cases = set.intersection(*(set(c) for c in cost.values())) if cost else set()
    if not cases:
        return []
    best = {k: min(c[k] for c in cost.values()) for k in cases}
    ranked = []
    for plan, c in cost.items():
        ratios = [c[k] / best[k] for k in sorted(cases)]
        ranked.append({"plan": plan, "mean_over_best": sum(ratios) / len(ratios), "worst_over_best": max(ratios)})
    return sorted(ranked, key=lambda x: x["mean_over_best"])


def report_mismatches(rows: list[dict]) -> bool:
    """Print each row whose LoRA output lies beyond RESULT_TOLERANCE from the reference plan's; any?"""
    wrong = [r for r in rows if not r["max_rel_diff_vs_exact"] <= RESULT_TOLERANCE]
    for r in wrong:
        print(f"RESULT MISMATCH: {r['group']} batch {r['batch']} adapters {r['distinct_adapters']} plan {r['plan']}: "
              f"{r['max_rel_diff_vs_exact']:.3g} of the output's magnitude from the exact plan", file=sys.stderr)
    return bool(wrong)


def plan_arguments(doc: str) -> argparse.ArgumentParser:
    """The options every launch-plan benchmark takes (this one and admission_shapes.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--groups", default="qkv,o")
    return ap


def main() -> None:
    ap = plan_arguments(__doc__)
    ap.add_argument("--batches", default="256")
    ap.add_argument("--distinct", default="1,5,25,100,256")
    ap.add_argument("--plans", choices=("graph", "shapes"), default="graph",
                    help="graph: the decode graphs' segment plans; shapes: shrink's and expand's launch shapes")
    ap.add_argument("--plan", action="append", default=[],
                    help="a plan to time (repeatable, e.g. --plan 'bound live 128 p128'); replaces --plans")
    args = ap.parse_args()
    if args.smoke:
        model, groups, batches, distinct, device, dtype, layers = "tiny", ["qkv"], [8], [1, 3], "cpu", torch.float32, 1
        plans = ("bound", "bound live 1", "bound live 16 m64", "bound live 16 p2", "bound live 16 p2 sc2 ec2",
                 "bound live 16 p2 sl2", "bound live 16 p2 sl0", "bound live 16 p2 ed", "bound live 16 p2 sd",
                 "bound live 16 p2 sd sl0", "bound n16 t2 w2",
                 "bound sk16 sw2", "bound rw r64 n16 t2", "bound g48 sg64", "exact live 16", "exact")
    else:
        model, device, dtype, layers = args.model, "cuda", torch.bfloat16, 8
        plans = tuple(args.plan) or (PLANS if args.plans == "graph" else SHAPE_PLANS)
        for text in plans:
            Plan.parse(text)  # a typo fails before any GPU time is spent
        groups = args.groups.split(",")
        batches = [int(b) for b in args.batches.split(",")]
        distinct = [int(d) for d in args.distinct.split(",")]
    rows = []

    def write(ranked=()) -> None:
        # After every case too, so a run cut short by its time limit keeps what it measured.
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows, "graph_plans": list(ranked)}, f, indent=1)

    for group in groups:
        for batch in batches:
            for d in distinct:
                if d > batch:
                    continue
                # Resident adapters enough for the largest count asked (an S2 n = 2000 step holds ~300).
                pool_adapters = max(distinct) if args.smoke else max(256, max(distinct))
                rows += measure(model, group, batch, d, plans, n_adapters=pool_adapters, num_layers=layers,
                                dtype=dtype, device=device)
                best = min(rows[-len(plans):], key=lambda r: r["both_us"])
                print(f"{group} batch {batch} adapters {d}: "
                      + ", ".join(f"{r['plan']} {r['both_us']:.1f}" for r in rows[-len(plans):])
                      + f" µs (best {best['plan']})", file=sys.stderr, flush=True)
                write()
    wrong = report_mismatches(rows)
    ranked = rank_graph_plans(rows)
    for x in ranked[:5]:
        print(f"graph plan {x['plan']}: {x['mean_over_best']:.3f} x the best on average, "
              f"{x['worst_over_best']:.3f} at worst", file=sys.stderr)
    write(ranked)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
