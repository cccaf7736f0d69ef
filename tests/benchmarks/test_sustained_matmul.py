"""benchmarks/sustained_matmul.py: its windows and summary on a CPU (the GPU run is in docs/benchmarks.md)."""
import json

from benchmarks import sustained_matmul as sm


def test_summary_compares_the_first_window_with_the_second_halfs_median():
    windows = [{"tflops": 100.0, "sm_mhz": 1980, "watts": 500.0, "reasons": ["0x0"]},
               {"tflops": 90.0, "sm_mhz": 1900, "watts": 650.0, "reasons": ["0x4"]},
               {"tflops": 80.0, "sm_mhz": 1800, "watts": 690.0, "reasons": ["0x4"]},
               {"tflops": 70.0, "sm_mhz": 1600, "watts": 700.0, "reasons": ["0x4"]}]
    s = sm.summarize(windows)
    assert s["burst_tflops"] == 100.0
    assert s["held_tflops"] == 75.0
    assert s["held_of_burst"] == 0.75
    assert (s["first_sm_mhz"], s["held_sm_mhz"], s["held_watts"]) == (1980, 1700, 695.0)
    assert s["held_reasons"] == ["0x4"]


def test_samples_go_to_the_window_they_fall_in():
    windows = [{"start": 10.0, "seconds": 1.0}, {"start": 11.0, "seconds": 1.0}]
    samples = [(10.2, 1900, 600.0, "0x0"), (10.8, 1800, 650.0, "0x4"), (11.5, 1500, 700.0, "0x4")]
    sm.attach_samples(windows, samples)
    assert (windows[0]["sm_mhz"], windows[0]["watts"], windows[0]["reasons"]) == (1850, 625.0, ["0x0", "0x4"])
    assert (windows[1]["sm_mhz"], windows[1]["reasons"]) == (1500, ["0x4"])


def test_a_cpu_run_writes_its_windows(tmp_path):
    out = tmp_path / "m.json"
    assert sm.main(["--seconds", "0.5", "--n", "32", "--window-s", "0.05", "--burst", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == "cpu" and result["n"] == 32
    assert len(result["windows"]) >= 2
    assert result["windows"][0]["products"] == 4
    assert all(w["tflops"] > 0 for w in result["windows"])
    assert result["summary"]["windows"] == len(result["windows"])
    assert result["summary"]["held_sm_mhz"] is None  # no nvidia-smi on a CPU


def test_replot_draws_an_earlier_run(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    assert sm.main(["--seconds", "0.3", "--n", "32", "--window-s", "0.05", "--burst", "2", "--out", str(out)]) == 0
    assert sm.main(["--replot", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
