"""The matmul rate a GPU holds under load, against the burst the roofline's ceiling is measured from.

`bench/roofline.py` times a few large bf16 products back to back: a burst, at the SM clock the GPU reaches before
its power draw catches up. Served steps that are bound by their FLOPs (an admission step's GEMMs, ~95 ms at a time
for S-GQA) run long enough for the power limit to pull the clock down. This runs the same product without pause
for `--seconds`, in windows of about `--window-s`, and reports each window's TFLOP/s beside the SM clock, power
draw and clock-event reasons sampled meanwhile (`nvidia-smi -lms`), then the first window against the median of
the second half.

    python3 benchmarks/sustained_matmul.py --seconds 20 --out sustained_matmul.json
    python3 benchmarks/sustained_matmul.py --seconds 1 --n 64 --out /tmp/m.json   # the script itself, on a CPU
    python3 benchmarks/sustained_matmul.py --replot sustained_matmul.json --plot sustained_matmul.png
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.held_matmul import held_tflops, run_windows

SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def start_sampler(interval_ms: int):
    """A background nvidia-smi writing one line per interval to a temporary file; None without one."""
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return None
    out = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                             f"-lms={interval_ms}"], stdout=out, stderr=subprocess.DEVNULL)
    return proc, out


def stop_sampler(sampler) -> list[tuple[float, int, float, str]]:
    """(seconds since the epoch, SM MHz, watts, reasons) per sample."""
    if sampler is None:
        return []
    proc, out = sampler
    proc.terminate()
    proc.wait(timeout=10)
    out.seek(0)
    samples = []
    for line in out:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            samples.append((stamp, int(parts[1]), float(parts[2]), parts[3]))
        except ValueError:
            continue  # a header or a line cut short by the stop
    out.close()
    return samples


def attach_samples(windows: list[dict], samples: list[tuple[float, int, float, str]]) -> None:
    for w in windows:
        inside = [s for s in samples if w["start"] <= s[0] <= w["start"] + w["seconds"]]
        w["sm_mhz"] = statistics.median(s[1] for s in inside) if inside else None
        w["watts"] = statistics.median(s[2] for s in inside) if inside else None
        w["reasons"] = sorted({s[3] for s in inside})


def summarize(windows: list[dict]) -> dict:
    """The first window (the burst) against the second half (held: bench.held_matmul.held_tflops)."""
    if len(windows) < 2:
        raise ValueError("under two windows ran: give --seconds more than the burst's time")
    second_half = windows[len(windows) // 2:]

    def median(key):
        values = [w[key] for w in second_half if w.get(key) is not None]
        return statistics.median(values) if values else None

    burst, held = windows[0]["tflops"], held_tflops(windows)
    return {"windows": len(windows), "burst_tflops": burst, "held_tflops": held,
            "held_of_burst": held / burst, "first_sm_mhz": windows[0].get("sm_mhz"),
            "held_sm_mhz": median("sm_mhz"), "held_watts": median("watts"),
            "held_reasons": sorted({r for w in second_half for r in w.get("reasons", [])})}


def plot(result: dict, path: str) -> None:
    """TFLOP/s and the SM clock per window over the run's seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = result["windows"]
    t0 = windows[0]["start"]
    t = [w["start"] - t0 + w["seconds"] / 2 for w in windows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [w["tflops"] for w in windows], marker="o", ms=3, label="bf16 matmul, TFLOP/s")
    ax.set_xlabel("seconds of back-to-back products")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    clocks = [(x, w["sm_mhz"]) for x, w in zip(t, windows) if w.get("sm_mhz") is not None]
    if clocks:
        ax2 = ax.twinx()
        ax2.plot([c[0] for c in clocks], [c[1] for c in clocks], color="tab:red", marker=".", ms=3,
                 label="SM clock, MHz")
        ax2.set_ylabel("SM clock, MHz")
        ax2.set_ylim(bottom=0)
        fig.legend(loc="center right", bbox_to_anchor=(0.9, 0.35))
    s = result["summary"]
    ax.set_title(f"{result['gpu']}, {result['n']}³: burst {s['burst_tflops']:.0f}, "
                 f"held {s['held_tflops']:.0f} TFLOP/s ({s['held_of_burst']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=0.5)
    p.add_argument("--n", type=int, default=0, help="matrix size (default 8192 on CUDA, 256 on a CPU)")
    p.add_argument("--sample-ms", type=int, default=100)
    p.add_argument("--burst", type=int, default=20, help="products in the first window (the roofline's repeats)")
    p.add_argument("--out", default="sustained_matmul.json")
    p.add_argument("--plot", help="also draw the windows to this PNG")
    p.add_argument("--replot", help="draw --plot from this earlier --out file instead of running")
    args = p.parse_args(argv)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot")
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        print(f"wrote {args.plot}")
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.n or (8192 if device == "cuda" else 256)
    sampler = start_sampler(args.sample_ms)
    print(f"{args.seconds:.0f} s of {n} x {n} products on {device}, windows of ~{args.window_s} s", flush=True)
    try:
        windows = run_windows(n, args.seconds, args.window_s, device, args.burst)
    finally:
        samples = stop_sampler(sampler)
    attach_samples(windows, samples)
    summary = summarize(windows)
    for i, w in enumerate(windows):
        if i % max(1, len(windows) // 10) == 0 or i == len(windows) - 1:
            print(f"  window {i:3d}: {w['tflops']:7.1f} TFLOP/s  SM {w['sm_mhz']} MHz  {w['watts']} W  "
                  f"{','.join(w['reasons'])}", flush=True)
    print(f"burst {summary['burst_tflops']:.1f} TFLOP/s, held {summary['held_tflops']:.1f} "
          f"({summary['held_of_burst']:.3f} of it), SM {summary['first_sm_mhz']} -> {summary['held_sm_mhz']} MHz, "
          f"{summary['held_watts']} W", flush=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = {"gpu": gpu, "n": n, "torch_version": torch.__version__, "summary": summary, "windows": windows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
