"""The admission-step launch-shape benchmark runs its plans on the real kernels (CPU interpreter, tiny shapes)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import torch

from bench import REPO, child_env


def test_admission_tokens_are_a_round_of_prompts_beside_running_decode_tokens():
    from benchmarks.kernels.admission_shapes import admission_tokens

    ids = admission_tokens(prompts=3, running=5, distinct=4, prompt_range=(20, 90), seed=0).tolist()
    lengths = [random.Random(i).randrange(20, 90) for i in range(3)]
    assert len(ids) == sum(lengths) + 5
    # Prompt i's tokens all use adapter i; running request j's one token uses adapter (3 + j) mod 4.
    assert ids[: lengths[0]] == [0] * lengths[0] and ids[sum(lengths):] == [3, 0, 1, 2, 3]


def test_smoke_run_launches_the_prefill_form_and_every_plan_matches(tmp_path):
    out = tmp_path / "a.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.admission_shapes", "--smoke", "--out", str(out)],
                         cwd=REPO, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    rows = {r["plan"]: r for r in result["rows"]}
    assert list(rows) == ["exact", "exact ci", "exact ci t2", "exact ci n16 w2", "exact ci sk16",
                          "exact ci em16"]
    assert result["distinct_adapters"] == 4 and all(r["segments"] == 4 for r in rows.values())
    # Runs longer than 64 tokens: the kernels split them into 64-token chunks, as an eager prefill step does;
    # "ci" launches the chunks that hold tokens from the step's list, not 4 segments times the longest's chunks.
    assert rows["exact"]["expand"]["chunk_tokens"] == 64 and rows["exact"]["expand"]["tiles_per_prog"] == 1
    from benchmarks.kernels.admission_shapes import admission_tokens

    runs = torch.bincount(admission_tokens(3, 5, 4, (20, 90)).long()).tolist()  # the smoke run's step
    assert rows["exact"]["chunk_items"] == 0
    assert rows["exact ci"]["chunk_items"] == sum(-(-n // 64) for n in runs) < 4 * -(-max(runs) // 64)
    assert rows["exact ci t2"]["expand"]["tiles_per_prog"] == 2 and rows["exact ci sk16"]["shrink"]["block_k"] == 16
    # "em16" changes expand's row tiles alone.
    em16 = rows["exact ci em16"]
    assert em16["expand"]["block_m"] == 16 and em16["shrink"] == rows["exact ci"]["shrink"]
    assert all(r["max_rel_diff_vs_exact"] < 1e-5 for r in rows.values())
    assert "tokens over 4 adapters" in run.stderr
