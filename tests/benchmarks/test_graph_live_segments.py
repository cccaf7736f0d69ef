"""The decode-graph LoRA launch benchmark runs its plans on the real kernels (CPU interpreter, tiny shapes)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import REPO, child_env


def test_smoke_run_plans_the_bound_and_the_live_segments_differently(tmp_path):
    out = tmp_path / "g.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.graph_live_segments", "--smoke", "--out", str(out)],
                         cwd=REPO, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    plans = ("bound", "bound live 1", "bound live 16 m64", "bound live 16 p2", "bound live 16 p2 sc2 ec2",
             "bound live 16 p2 sl2", "bound live 16 p2 sl0", "bound live 16 p2 ed", "bound live 16 p2 sd",
             "bound live 16 p2 sd sl0", "bound n16 t2 w2", "bound sk16 sw2", "bound rw r64 n16 t2", "bound g48 sg64",
             "exact live 16", "exact")
    assert [(r["distinct_adapters"], r["plan"]) for r in rows] == [(d, plan) for d in (1, 3) for plan in plans]
    by_plan = {(r["distinct_adapters"], r["plan"]): r for r in rows}
    # One segment per token (8) unless the count is exact; the input split follows the plan.
    assert by_plan[(1, "bound")]["segments"] == 8 and by_plan[(1, "exact")]["segments"] == 1
    # The bound's split is the graphs' least (GRAPH_SHRINK_MIN_SPLIT), as far as the tiny inputs allow (two
    # ways); a single live segment's plan fills the GPU from one segment and so splits as far.
    assert by_plan[(1, "bound")]["n_split"] == 2 == by_plan[(1, "bound live 1")]["n_split"] == \
        by_plan[(1, "exact")]["n_split"]
    for d in (1, 3):
        assert by_plan[(d, "bound live 16 m64")]["block_m"] == 64
        assert by_plan[(d, "bound live 16 p2")]["segment_programs"] == 2
        # The exact segments under the bound's 16-segment plan: the same launch shapes without the empty
        # segment programs.
        shaped = by_plan[(d, "exact live 16")]
        assert shaped["segments"] == d and shaped["n_split"] == by_plan[(d, "bound live 16 m64")]["n_split"]
    # Each kernel's launch shape, and nothing else, follows its words.
    def changed(plan, kernel):
        return {k: v for k, v in by_plan[(3, plan)][kernel].items() if v != by_plan[(3, "bound")][kernel][k]}

    assert changed("bound n16 t2 w2", "expand") == {"block_n": 16, "tiles_per_prog": 2, "num_warps": 2}
    assert changed("bound n16 t2 w2", "shrink") == {}
    assert changed("bound sk16 sw2", "shrink") == {"block_k": 16, "num_warps": 2}
    assert changed("bound sk16 sw2", "expand") == {}
    # Registers a thread: the graph's expand is capped by default (kernel_shapes expand_registers), shrink is not.
    assert by_plan[(3, "bound")]["expand"]["max_registers"] == 56 and by_plan[(3, "bound")]["shrink"]["max_registers"] == 0
    assert changed("bound g48 sg64", "expand") == {"max_registers": 48}
    assert changed("bound g48 sg64", "shrink") == {"max_registers": 64}
    assert changed("bound rw r64 n16 t2", "expand") == {"rank_whole": True, "block_r": 64, "block_n": 16,
                                                         "tiles_per_prog": 2}
    # Segments shared out among two programs, each taking 2-token chunks of them (four chunks of 8 tokens).
    for kernel in ("shrink", "expand"):
        chunked, whole = by_plan[(3, "bound live 16 p2 sc2 ec2")][kernel], by_plan[(3, "bound live 16 p2")][kernel]
        assert {k: v for k, v in chunked.items() if v != whole[k]} == {"chunk_tokens": 2}
    # Segments of more than 2 tokens in 64-row tiles, the rest in 16-row ones: shrink's launch alone changes.
    # Shared-out programs choose per segment from 16 tokens by default; sl0 keeps one height.
    tall, short = by_plan[(3, "bound live 16 p2 sl2")], by_plan[(3, "bound live 16 p2 sl0")]
    assert {k: v for k, v in tall["shrink"].items() if v != short["shrink"][k]} == {"block_m_long": 64, "long_from": 2}
    assert tall["expand"] == short["expand"]
    # Expand's token tiles dealt to the two programs in turn: expand's launch alone changes.
    dealt, walked = by_plan[(3, "bound live 16 p2 ed")], by_plan[(3, "bound live 16 p2")]
    assert {k: v for k, v in dealt["expand"].items() if v != walked["expand"][k]} == {"deal_tiles": True}
    assert dealt["shrink"] == walked["shrink"]
    dealt = by_plan[(3, "bound live 16 p2 sd")]
    assert {k: v for k, v in dealt["shrink"].items() if v != walked["shrink"][k]} == {"deal_tiles": True}
    assert dealt["expand"] == walked["expand"]
    default = by_plan[(3, "bound live 16 p2")]["shrink"]
    assert (default["block_m_long"], default["long_from"]) == (64, 16)
    assert all(r["adapter_bytes"] > 0 for r in rows)
    # Every plan gives the exact plan's LoRA output (fp32 here: the same up to summation order).
    assert all(r["max_rel_diff_vs_exact"] < 1e-5 for r in rows), [r["max_rel_diff_vs_exact"] for r in rows]
    assert "qkv batch 8 adapters 3:" in run.stderr


def test_plans_are_read_from_their_words():
    from benchmarks.kernels.graph_live_segments import PLANS, SHAPE_PLANS, Plan

    assert Plan.parse("bound live 16 p32") == Plan(exact=False, live=16, programs=32)
    assert Plan.parse("exact") == Plan(exact=True)
    assert Plan.parse("exact ci t2") == Plan(exact=True, chunk_items=True, expand=(("tiles_per_prog", 2),))
    assert Plan.parse("bound n256 w8") == Plan(exact=False, expand=(("block_n", 256), ("num_warps", 8)))
    assert Plan.parse("bound cf t4") == Plan(exact=False, expand=(("cols_first", True), ("tiles_per_prog", 4)))
    assert Plan.parse("bound live 32 p32 sm64") == Plan(exact=False, live=32, programs=32, shrink=(("block_m", 64),))
    assert Plan.parse("bound live 32 p32 sl16") == Plan(exact=False, live=32, programs=32,
                                                        shrink=(("block_m_long", 64), ("long_from", 16)))
    assert Plan.parse("bound live 32 p32 sc64 ec64") == Plan(exact=False, live=32, programs=32,
                                                             expand=(("chunk_tokens", 64),),
                                                             shrink=(("chunk_tokens", 64),))
    assert Plan.parse("bound live 32 p32 ed") == Plan(exact=False, live=32, programs=32,
                                                      expand=(("deal_tiles", True), ("chunk_tokens", 0)))
    assert Plan.parse("bound live 32 p32 sd sl0") == Plan(exact=False, live=32, programs=32, shrink=(
        ("deal_tiles", True), ("chunk_tokens", 0), ("block_m_long", 0), ("long_from", 0)))
    assert Plan.parse("bound rw r64 t4") == Plan(exact=False, expand=(("rank_whole", True), ("block_r", 64),
                                                                      ("tiles_per_prog", 4)))
    # Two-letter shrink words before expand's one-letter ones: "ss3" is shrink's stages, "s3" expand's.
    assert Plan.parse("exact ss3 s1 sx2") == Plan(exact=True, expand=(("num_stages", 1),),
                                                   shrink=(("num_stages", 3), ("n_split", 2)))
    assert all(Plan.parse(p) for p in PLANS + SHAPE_PLANS)
    for bad in ("live 16", "bound q3", "bound nx", ""):
        with pytest.raises(ValueError, match="plan"):
            Plan.parse(bad)


def test_graph_plans_are_ranked_by_their_cost_over_the_best_per_case():
    from benchmarks.kernels.graph_live_segments import rank_graph_plans

    def row(plan, d, group, us):
        return {"plan": plan, "batch": 256, "distinct_adapters": d, "group": group, "both_us": us}

    rows = [row("bound", 5, "qkv", 40.0), row("bound", 5, "o", 20.0), row("bound", 100, "qkv", 30.0),
            row("bound", 100, "o", 10.0),
            row("bound live 16", 5, "qkv", 20.0), row("bound live 16", 5, "o", 10.0),
            row("bound live 16", 100, "qkv", 36.0), row("bound live 16", 100, "o", 12.0),
            row("exact", 5, "qkv", 1.0), row("exact", 5, "o", 1.0)]  # not a graph's: left out
    ranked = rank_graph_plans(rows)
    # live 16: 30/30 at n = 5, 48/40 at n = 100; the bound: 60/30 and 40/40.
    assert [x["plan"] for x in ranked] == ["bound live 16", "bound"]
    assert ranked[0]["mean_over_best"] == 1.1 and ranked[0]["worst_over_best"] == 1.2
    assert ranked[1]["mean_over_best"] == 1.5 and ranked[1]["worst_over_best"] == 2.0
    assert rank_graph_plans([row("bound", 5, "qkv", float("nan"))]) == []


def test_a_plan_beyond_the_tolerance_is_reported(capsys):
    from benchmarks.kernels.graph_live_segments import RESULT_TOLERANCE, report_mismatches

    def row(plan, diff):
        return {"group": "qkv", "batch": 256, "distinct_adapters": 100, "plan": plan, "max_rel_diff_vs_exact": diff}

    assert not report_mismatches([row("bound", 0.0), row("bound t2", RESULT_TOLERANCE)])
    assert report_mismatches([row("bound", 0.0), row("bound t4", 0.5), row("bound r16", float("nan"))])
    err = capsys.readouterr().err
    assert "plan bound t4: 0.5 of the output's magnitude" in err and "plan bound r16: nan" in err
    assert "plan bound:" not in err
