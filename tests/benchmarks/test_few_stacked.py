"""The few-adapter LoRA benchmark runs the kernels' plans and the dense products on the same work (CPU, tiny)."""
from __future__ import annotations

import json
import subprocess
import sys

from bench import REPO, child_env


def test_smoke_run_holds_every_stacked_plan_to_the_kernels_exact_output(tmp_path):
    out = tmp_path / "f.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.few_stacked", "--smoke", "--distinct", "3",
                          "--groups", "qkv,down", "--paddings", "64,512", "--out", str(out),
                          "--plot", str(tmp_path / "f.png")],
                         cwd=REPO, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    plans = ["kernels", "kernels exact", "stacked", "stacked rows", "stacked c512"]
    assert [(r["group"], r["plan"]) for r in rows] == [(g, p) for g in ("qkv", "down") for p in plans]
    for r in rows:
        assert r["max_rel_diff_vs_exact"] < 1e-5, r
    # Three adapters of the pool's ranks (8, 16, 32, 64 in turn), drawn as the script draws them: the tight stack
    # holds their ranks summed, and a padding narrower than that (64 here) is no plan of its own.
    import torch

    from benchmarks.kernels.graph_live_segments import batch_of

    drawn = batch_of(3, 16, 256, torch.Generator().manual_seed(0 + 16 + 3)).unique().tolist()
    need = sum((8, 16, 32, 64)[a % 4] for a in drawn)
    stacked = [r for r in rows if r["plan"] == "stacked"]
    assert [r["columns"] for r in stacked] == [need, need] and need > 64
    assert "[2/2] tiny down batch 16 over 3:" in run.stderr
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_each_setting_from_timed_rows(tmp_path):
    from benchmarks.kernels.few_stacked import PLOTTED, plot_rows

    rows = [{"model": m, "batch": b, "group": g, "distinct_adapters": n, "plan": plan, "us": 10.0 + i}
            for m, b in (("llama3-8b", 512), ("llama2-7b", 384)) for g in ("qkv", "o") for n in (2, 5)
            for i, plan in enumerate(PLOTTED)]
    plot_rows(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
