"""The kernel proof's served and mixed-step attention sections run on the real kernels (CPU interpreter, tiny
shapes): every launch-shape variant and the decode rows launched apart give the chosen launch's output."""
from __future__ import annotations

import json
import subprocess
import sys

from bench import REPO, child_env


def test_served_and_mixed_attention_sections_run_and_agree_with_the_chosen_launch(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.gpu_proof", "--smoke", "--only",
                          "attention_served,attention_mixed", "--out", str(tmp_path)],
                         cwd=REPO, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "kernels.json").read_text())
    assert results["errors"] == {}
    served = results["attention_served"]
    # Per model: single-token pages in the batch's own pool, then 4-slot runs in a 200-slot pool.
    assert [(r["model"], r["slot_run"]) for r in served] == [("tiny", 1), ("tiny", 4)] * 2
    assert served[1]["pool_slots"] == 200 and served[0]["pool_slots"] < 200
    for row in served:
        diffs = {k: v for k, v in row.items() if k.endswith("_max_diff")}
        assert {k[5:-9] for k in diffs} == {"block_n 64", "block_n 64 stages 4", "block_n 32 stages 4",
                                            "block_n 64 warps 2", "heads first", "heads first block_n 64"}
        # fp16 inputs, fp32 sums: other block sizes only reorder the sums.
        assert all(v < 1e-2 for v in diffs.values()), diffs
        assert 4 < row["context_mean"] <= row["context_max"] <= 41
    mixed = results["attention_mixed"]
    assert [(r["running"], r["prompts"]) for r in mixed] == [(4, 2), (4, 2)]
    assert all(r["max_diff_apart_vs_one"] < 1e-2 and r["prompt_tokens"] >= 8 for r in mixed)
    tables = (tmp_path / "kernels.md").read_text()
    assert "decode rows apart µs" in tables and "mean context" in tables


def test_paged_kv_lays_contexts_out_in_runs_of_consecutive_slots_within_the_pool_asked_for():
    import torch

    from benchmarks.kernels.shapes import llama_config, paged_kv

    cfg = llama_config("tiny")
    ctx = [5, 9, 1, 8]
    kv, meta = paged_kv(cfg, [1] * 4, ctx, torch.float32, "cpu", slot_run=4, pool_slots=100)
    assert kv.shape[1] == 100
    table = meta.slot_table.tolist()
    seen = set()
    for row, n in zip(table, ctx):
        slots = row[:n]
        assert slots[0] % 4 == 0  # each sequence starts a run
        assert all(b == a + 1 for i, (a, b) in enumerate(zip(slots, slots[1:])) if (i + 1) % 4), slots
        assert not seen & set(slots) and all(0 <= s < 100 for s in slots)
        seen |= set(slots)
    # Single slots in the batch's own pool: the layout the kernel table was measured on.
    kv, meta = paged_kv(cfg, [1] * 4, ctx, torch.float32, "cpu")
    expected = torch.randperm(sum(ctx) + 16, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    assert kv.shape[1] == sum(ctx) + 16
    assert meta.slot_table[1, :9].tolist() == expected[5:14].tolist()
