"""The targets figure: each target's measured share of what it asks, beside the most its rooflines allow."""
import subprocess
import sys

import pytest

from bench import REPO, child_env
from bench.targets_plot import plot_targets, scores
from tests.bench.test_targets import line, write


def points(tmp_path):
    return write(tmp_path / "s2.jsonl", [
        line("loraplex", 2000, 27.0, 40.0, attainable_rps=36.0, run="r1"),
        line("loraplex", 5, 30.0, 45.0, run="r1"),
        line("loraplex", 100, 33.0, 44.0, run="r1"),
        line("base-only", 100, 32.0, 46.0, run="r1"),
        line("peft", 100, 0.3, 44.0, run="r0"),  # another run: its ratio says so
        line("loraplex", 5, 24.0, 50.0, setting="S-GQA", attainable_rps=38.0, run="r2"),
    ])


def test_each_target_is_its_share_of_what_it_asks_and_its_rooflines_limit(tmp_path):
    s = {x.target: x for x in scores([points(tmp_path)])}
    top = s["S2 n = 2000 ≥ 30 req/s"]
    assert top.share == pytest.approx(27.0 / 30) and top.limit == pytest.approx(36.0 / 30)
    far = s["S2 n = 2000 ≥ 0.9 × n = 5"]
    assert far.share == pytest.approx(27.0 / 30.0 / 0.9) and far.limit == pytest.approx(40.0 / 45.0 / 0.9)
    assert far.measured == "0.90×"
    # PEFT runs on loraplex's trace without a roofline of its own: no limit; two runs where one is asked.
    peft = s["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.share == pytest.approx(110.0 / 30) and peft.limit is None and peft.measured == "110.00× (two runs)"
    gqa = s["S-GQA n = 5 ≥ 60% of the roofline"]
    assert gqa.share == pytest.approx(0.48 / 0.6) and gqa.limit == pytest.approx(38.0 / 50.0 / 0.6)
    # A point without attainable_rps has no limit drawn; the roofline fraction still scored.
    assert s["S2 n = 5 ≥ 60% of the roofline"].limit is None
    assert s["S2 n = 5 ≥ 60% of the roofline"].share == pytest.approx(30.0 / 45.0 / 0.6)
    assert list(s)[:4] == ["S2 n = 2000 ≥ 30 req/s", "S2 n = 2000 ≥ 0.9 × n = 5",
                           "S2 n = 100 ≥ 0.9 × base-only n = 100", "S2 n = 100 ≥ 30 × peft n = 100"]
    # A run that measured both sides stands for the target over the later lines of two runs.
    earlier = {"run": "r00", "started": "2026-11-30T10:00:00+00:00"}
    both = write(tmp_path / "s2-baselines.jsonl", [line("loraplex", 100, 28.0, 44.0, **earlier),
                                                   line("peft", 100, 0.4, 44.0, **earlier)])
    peft = {x.target: x for x in scores([points(tmp_path), both])}["S2 n = 100 ≥ 30 × peft n = 100"]
    assert peft.share == pytest.approx(70.0 / 30) and peft.measured == "70.00×"


def test_the_figure_draws_every_score_as_a_bar_of_its_share(tmp_path):
    path = points(tmp_path)
    png = tmp_path / "fig" / "targets.png"
    drawn = plot_targets([path], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    want = scores([path])
    assert [d.target for d in drawn] == [w.target for w in want]
    assert [d.share for d in drawn] == pytest.approx([w.share for w in want])
    # Lines measured on another GPU are not the targets' points: nothing to draw, no file.
    h100 = write(tmp_path / "h100.jsonl", [line("loraplex", 2000, 27.0, 40.0, gpu="NVIDIA H100 80GB HBM3")])
    assert plot_targets([h100], tmp_path / "none.png") == [] and not (tmp_path / "none.png").exists()


def test_targets_command_writes_the_figure(tmp_path):
    path = points(tmp_path)
    png = tmp_path / "targets.png"
    out = subprocess.run([sys.executable, "-m", "shared.cli", "bench", "targets", path, "--plot", str(png)], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "| target | measured | what the rooflines allow | status |"
    assert out.stdout.splitlines()[-1] == f"{png}: {len(scores([path]))} targets drawn"
    assert png.stat().st_size > 10_000
