"""`loraplex bench`: every action explains itself, refuses bad input by name, and does its job on a CPU."""
import json
import re

import pytest

from bench import REPO
from bench.cli import main
from shared.cli import COMMANDS


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_is_a_loraplex_command():
    assert COMMANDS["bench"][0] == "bench.cli:main"


def test_help_explains_every_action(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for action in ("run", "sweep", "plot", "roofline", "adapters"):
        assert action in out
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "--budget-s" in out and "again" in out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--policy" in capsys.readouterr().out


def test_roofline_with_ceilings_given_measures_nothing_and_says_what_the_gemms_allow(capsys):
    code, out, _ = run(capsys, "roofline", "--setting", "S2", "--n", "2000", "--rate", "40", "--duration-s", "140",
                       "--batch", "384", "--hbm-gbs", "4200", "--matmul-tflops", "764")
    assert code == 0
    first, second = out.splitlines()
    assert first == "given: device-to-device copy 4200.0 GB/s, bfloat16 matmul 764.00 TFLOP/s"
    # Past the ridge point the linears take their FLOPs' time: less than the roofline, by a tenth or so here.
    figures = re.search(r"roofline ([0-9.]+) req/s; .*: ([0-9.]+) req/s, ([0-9.]+) of the roofline", second)
    roof, attainable, share = (float(x) for x in figures.groups())
    assert 0.8 < share < 0.95 and attainable / roof == pytest.approx(share, abs=0.005)
    code, _, err = run(capsys, "roofline", "--hbm-gbs", "4200")
    assert code == 2 and "--matmul-tflops" in err


def test_roofline_on_a_cpu_prints_ceilings_and_throughput(capsys):
    code, out, _ = run(capsys, "roofline", "--setting", "tiny", "--device", "cpu", "--n", "4", "--rate", "5",
                       "--duration-s", "10", "--batch", "8", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["setting"] == "tiny" and result["batch"] == 8 and result["roofline_rps"] > 0
    assert 0 < result["attainable_rps"] <= result["roofline_rps"]
    assert result["ceilings"]["device"] == "cpu" and result["ceilings"]["hbm_gbs"] > 0
    assert result["ceilings"]["matmul_held_tflops"] > 0 and result["roofline_rps_held"] > 0
    code, out, _ = run(capsys, "roofline", "--setting", "tiny", "--device", "cpu", "--n", "4", "--rate", "5",
                       "--duration-s", "10", "--batch", "8")
    assert code == 0 and re.search(r"matmul held back to back [0-9.]+ TFLOP/s \([0-9.]+ of the burst\): roofline "
                                   r"[0-9.]+ req/s", out.splitlines()[-1])


def test_adapters_writes_a_population(capsys, tmp_path):
    code, out, _ = run(capsys, "adapters", "tiny", "--n", "5", "--dir", str(tmp_path / "pop"), "--budget-gb", "0.0001")
    assert code == 0 and "5 adapters" in out
    assert sorted(p.name for p in (tmp_path / "pop").iterdir() if p.is_dir()) == [f"adapter-0000{i}" for i in range(5)]


def test_plot_writes_pngs(capsys, tmp_path):
    rows = [{"setting": "S1", "system": "loraplex", "n_adapters": n, "alpha": 1.0, "req_rate": 40.0, "cv": 1.0,
             "policy": "early-abort", "throughput_rps": 8.0 - n / 1000} for n in (5, 100)]
    (tmp_path / "s1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run(capsys, "plot", str(tmp_path / "s1.jsonl"))
    assert code == 0 and "s1-throughput-vs-adapters-S1.png (1 lines)" in out
    assert (tmp_path / "s1-throughput-vs-adapters-S1.png").is_file()


@pytest.mark.parametrize("argv,message", [
    (["roofline", "--setting", "S3", "--device", "cpu"], "unknown setting 'S3'"),
    (["run", "--setting", "tiny", "--rate", "1", "--system", "vllm"], "unknown system 'vllm'"),
    (["sweep", "no-such-spec.yaml"], "no-such-spec.yaml"),
    (["sweep", str(REPO / "bench" / "sweeps" / "s2-rate.yaml"), "--only", "/R=28/", "--only", "/R=99/", "--dry-run"],
     "--only '/R=99/' matches no point of the sweep (keys look like S2/loraplex/n=200/alpha=1/R=4/"),
])
def test_bad_input_is_refused_by_name(capsys, tmp_path, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_sweep_dry_run_lists_what_remains(capsys, tmp_path):
    spec = tmp_path / "dry.yaml"
    spec.write_text("setting: S2\nsystems: [loraplex, bmm]\nn: [5, 100]\nrates: [40]\n")
    code, out, _ = run(capsys, "sweep", str(spec), "--dry-run", "--out-dir", str(tmp_path))
    assert code == 0
    assert "stack S2/loraplex/None/early-abort: 0 done, 2 to run" in out
    assert "S2/bmm/n=100/alpha=1/R=40/cv=1/early-abort/d=120/seed=0" in out
