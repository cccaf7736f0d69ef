"""The soak script, short: about a minute of steady load at 80% of measured capacity with connections
dropped at random, on its own launched stack; it must end with zero errors, every free slot and arena figure
back at its baseline, and each service's RSS within the tolerance (scripts/soak.py --help; the 30-minute
run is recorded in docs/reliability.md)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import REPO


def test_short_soak_leaves_the_stack_as_it_found_it(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--minutes", "0.75", "--capacity-s", "8",
           "--progress-s", "15", "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert run.returncode == 0 and summary["passed"], json.dumps(summary, indent=1)[:4000] + run.stdout[-2000:]
    assert summary["error_count"] == 0 and summary["mismatches"] == 0
    assert all(summary["checks"].values())
    assert summary["sent"] > 100 and summary["dropped"] > 0, "the soak sent too little to mean anything"
    assert summary["achieved_rps"] > 0.5 * summary["target_rps"]
    assert "t=" in run.stdout, "no progress was printed"
