"""LoRA shrink + expand of an admission step at saturation, under launch shapes around the kernels' choice.

At S2 saturation an admission step prefills a round of 32 prompts beside 224 running requests' decode tokens,
over 100 adapters; its expand took 351 µs a call, ~5× the time to read and write the step's projection outputs
at the copy ceiling (docs/benchmarks.md). Each row times one plan of `graph_live_segments` (only "exact" plans:
an eager step knows its segments and its longest run) on that step's tokens, µs per layer call, and checks its
LoRA output against the launch over every segment ("exact"). Plan words as in graph_live_segments.py.

    python -m benchmarks.kernels.admission_shapes --out admission_shapes.json
    python -m benchmarks.kernels.admission_shapes --smoke --out /tmp/a.json   # CPU interpreter, tiny shapes
"""
from __future__ import annotations

import json
import random
import sys

import torch

from benchmarks.kernels.graph_live_segments import Plan, measure, plan_arguments, report_mismatches

# "exact" launches every segment with the longest one's chunk count, "exact ci" one program per chunk that holds
# tokens (the engine's eager steps); the shapes are tried on the latter. "t1": expand's one column tile a program,
# its choice before 2026-12-02. "em16"/"em64": expand's chunks in 16- or 64-row tiles, shrink's unchanged.
# "r16"/"r32": expand's rank steps; "sk64"/"sk128": shrink's input tiles. lora_groups.full_on_average picks
# each of these (below it 16-row tiles, 16-row rank steps, 128-column input tiles; from it 64, 32 and 64).
# "sx2"/"sx4": shrink's inputs split more ways than planned (the plan counts every segment times the longest
# one's chunks, ~3.7x the programs an admission step runs); on the H200 both were slower than the plan (q,k,v
# 111 / 119 against 84 µs). "sx1 t1": shrink unsplit, expand one column tile a program: a step of short
# segments' shapes before 2026-12-05 (choose_shrink_config's chunk_programs).
ADMISSION_PLANS = ("exact", "exact ci", "exact ci sx1 t1", "exact ci t1", "exact ci t2", "exact ci w8", "exact ci n64",
                   "exact ci n64 w8",
                   "exact ci n256 w8", "exact ci r16", "exact ci r32", "exact ci s1", "exact ci s3", "exact ci m16",
                   "exact ci em16", "exact ci em64", "exact ci sw8",
                   "exact ci sk64", "exact ci sk128", "exact ci ss2", "exact ci ss4", "exact ci sx2", "exact ci sx4")


def admission_tokens(prompts: int, running: int, distinct: int, prompt_range: tuple[int, int],
                     seed: int = 0) -> torch.Tensor:
    """Adapter ids of one admission step's tokens: `prompts` prompts (lengths uniform in prompt_range, as
    benchmarks/profile_prefill.py draws them) and one decode token for each of `running` requests, every
    request on adapter (its index mod `distinct`)."""
    lengths = [random.Random(seed + i).randrange(*prompt_range) for i in range(prompts)]
    ids = [i % distinct for i, n in enumerate(lengths) for _ in range(n)]
    ids += [(prompts + j) % distinct for j in range(running)]
    return torch.tensor(ids, dtype=torch.int32)


def main() -> None:
    ap = plan_arguments(__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--running", type=int, default=224)
    ap.add_argument("--distinct", type=int, default=100)
    ap.add_argument("--plan", action="append", default=[],
                    help="a plan to time (repeatable, e.g. --plan 'exact ci sx2'); replaces ADMISSION_PLANS")
    args = ap.parse_args()
    if args.smoke:
        model, groups, device, dtype, layers = "tiny", ["qkv"], "cpu", torch.float32, 1
        token_adapter = admission_tokens(3, 5, 4, (20, 90))
        plans, n_adapters = ("exact", "exact ci", "exact ci t2", "exact ci n16 w2", "exact ci sk16", "exact ci em16"), 8
    else:
        model, device, dtype, layers = args.model, "cuda", torch.bfloat16, 8
        groups = args.groups.split(",")
        token_adapter = admission_tokens(args.prompts, args.running, args.distinct, (8, 512))
        plans, n_adapters = tuple(args.plan) or ADMISSION_PLANS, max(256, args.distinct)
        for text in plans:
            Plan.parse(text)  # a typo fails before any GPU time is spent
    tokens, distinct = token_adapter.shape[0], int(torch.unique(token_adapter).numel())
    rows = []
    for group in groups:
        group_rows = measure(model, group, tokens, distinct, plans, n_adapters=n_adapters, num_layers=layers,
                             dtype=dtype, device=device, token_adapter=token_adapter)
        rows += group_rows
        best = min(group_rows, key=lambda r: r["both_us"])
        print(f"{group}, {tokens} tokens over {distinct} adapters: "
              + ", ".join(f"{r['plan']} {r['shrink_us']:.0f}+{r['expand_us']:.0f}" for r in group_rows)
              + f" µs (best {best['plan']})", file=sys.stderr, flush=True)
    wrong = report_mismatches(rows)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                   "tokens": tokens, "distinct_adapters": distinct, "rows": rows}, f, indent=1)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
