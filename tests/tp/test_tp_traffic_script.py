"""scripts/tp_traffic.py runs a real TP group and reports counted traffic against the paper's formula."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_script_reports_counts_equal_to_the_formula():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tp_traffic.py"), "--tp", "2", "--hidden", "128", "--heads", "4",
         "--intermediate", "256", "--layers", "2", "--batch", "4", "--rank", "16"],
        capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "decode step: B = 4 tokens" in out
    # 5·(N−1)/N·B·r = 5 · 1/2 · 4 · 16 = 160 elements per layer, equal to what the engine counted.
    assert "paper: LoRA 5·(N−1)/N·B·r = 160 (640 B) (equal)" in out
    assert "lora_all_gather" in out and "MISMATCH" not in out
    assert out.rstrip().endswith("counted traffic matches the formula")
