"""One sweep spread over a host's GPUs: a driver per GPU ("lane"), each running its share of the points.

`loraplex bench sweep SPEC --gpus N` (or `--gpus 2,3`: these GPUs, so another sweep can have the rest)
writes the adapter population first (one writer), then starts a driver per GPU, the i-th of N with
CUDA_VISIBLE_DEVICES set to its GPU and shard i/N: every N-th point still missing from the results file,
so the shares are disjoint and cover the rest. Each lane starts its own stacks on its GPU,
with its own registry and blobs (data/<population>-gpuI), and appends its lines to the shared results
file under a lock. Points measured side by side on one host share its CPUs, RAM and disk, not a GPU:
each stack's service CPU time is in its lines (`service_cpu_cores`) to show they did not run short.
Exit status as a single driver's: 0 when the sweep is complete, 3 when more pieces are needed, 1 when a
lane failed.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import REPO, child_env

LANE_FAILED = 1


def lane_argv(spec: str, gpu: int, shard: int, shards: int, budget_s: float, work_dir: Path, out_dir: str,
              since: str, quiet: bool, only: tuple[str, ...] = (), run: str = "") -> list[str]:
    argv = [sys.executable, "-m", "shared.cli", "bench", "sweep", spec, "--budget-s", f"{budget_s:.0f}",
            "--work-dir", str(work_dir), "--out-dir", out_dir, "--gpu", str(gpu), "--shard", f"{shard}/{shards}"]
    if run:
        argv += ["--run", run]
    if since:
        argv += ["--since", since]
    for text in only:
        argv += ["--only", text]
    return argv + (["--quiet"] if quiet else [])


def _relay(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix} {line}")
        sink.flush()


def run_lanes(argvs: list[list[str]], labels: list[str]) -> list[int]:
    """Run the lanes' drivers side by side, their output relayed with a [gpuI] prefix; their exit codes.
    A lane still running when this process is told to stop is stopped with it (SIGTERM: its stack stops)."""
    procs, relays = [], []
    try:
        for i, argv in enumerate(argvs):
            proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), text=True,  # its --gpu picks the device
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_relay, args=(stream, f"[{labels[i]}]", sink), daemon=True)
                t.start()
                relays.append(t)
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 60
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
    for t in relays:
        t.join(timeout=5)
    return codes


def sweep_on_gpus(driver, spec_path: str, gpus: list[int], work_dir: Path, out_dir: str, since: str,
                  quiet: bool) -> int:
    """The parent of `--gpus N`: population first, then the lanes; the sweep's exit status."""
    from bench.driver import ADAPTER_SYSTEMS, MORE_PIECES, done_keys, expand, point_key, selected

    points = selected(expand(driver.spec), driver.only)
    done = done_keys(driver.results, since)  # read once: the results file may be long
    todo = [p for p in points if point_key(p) not in done]
    n = max((p.n_adapters for p in todo if p.system in ADAPTER_SYSTEMS), default=0)
    if n:
        population = driver.population(n)  # one writer: lanes would race on the same names
        if not population.complete:
            sys.stdout.write("stopped: adapter generation reached the budget; run the same command again to continue\n")
            return MORE_PIECES
    budget = driver.left()
    argvs = [lane_argv(spec_path, gpu, i, len(gpus), budget, work_dir, out_dir, since, quiet, driver.only, driver.run)
             for i, gpu in enumerate(gpus)]
    codes = run_lanes(argvs, [f"gpu{gpu}" for gpu in gpus])
    done = done_keys(driver.results, since)
    remaining = sum(point_key(p) not in done for p in points)
    sys.stdout.write(f"{driver.spec.name}: {len(points) - remaining} of {len(points)} points in {driver.results} "
                     f"(lanes exited {codes})\n")
    if any(code not in (0, MORE_PIECES) for code in codes):
        return LANE_FAILED
    if remaining:
        sys.stdout.write("stopped: run the same command again to continue\n")
        return MORE_PIECES
    return 0
