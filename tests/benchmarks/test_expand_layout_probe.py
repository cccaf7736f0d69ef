"""The expand layout probe reads the same adapter rows stored row by row and column tile first (CPU, tiny)."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from bench import REPO, child_env
from benchmarks.kernels.expand_layout_probe import TILE, layout_rows
from tests.benchmarks.sm90 import compile_env


def test_column_tile_first_rows_hold_each_tile_in_one_run():
    rank, n_out, width = 4, 2 * TILE, TILE
    b = torch.arange(rank * n_out, dtype=torch.float32).reshape(rank, n_out)
    assert torch.equal(layout_rows(b, False, width), b.reshape(-1, width))
    tiled = layout_rows(b, True, width)
    # Slot t * rank + i holds row i's columns of tile t.
    for t in range(n_out // TILE):
        for i in range(rank):
            assert torch.equal(tiled[t * rank + i], b[i, t * TILE:(t + 1) * TILE])


def test_smoke_run_checks_both_layouts_against_the_reference(tmp_path):
    # 64-column tiles: two to a 128-column run, so a tile starts inside its run as well as at its start.
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.expand_layout_probe", "--smoke", "--tiles", "2",
                          "--groups", "3,1", "--block-n", "64",
                          "--out", str(out)],
                         cwd=REPO, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["groups"], r["scatter"], r["tiles"]) for r in rows] == [
        (3, True, 2), (3, False, 2), (1, True, 2), (1, False, 2)]
    assert "[4/4]" in run.stderr
    for r in rows:
        assert r["max_rel_err"] < 1e-5, r


def test_both_layouts_compile_to_the_same_wide_loads(tmp_path):
    # Without its alignment hint the column-tile-first kernel read its rows 2 bytes a load (at 128 columns, 64 more
    # loads a thread than row by row) and timed 3-6x slower for it on an H100: a probe defect, not the layout's cost.
    out = tmp_path / "loads.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.expand_layout_probe", "--ptx-loads",
                          "--block-n", "64", "--out", str(out)],
                         cwd=REPO, env=compile_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loads = json.loads(out.read_text())
    assert loads["tiled"] == loads["rows"]
    assert loads["rows"].get("16", 0) >= 1, loads
