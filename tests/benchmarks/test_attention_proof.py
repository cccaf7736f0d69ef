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
    assert [r["model"] for r in served] == ["tiny", "tiny"]
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
