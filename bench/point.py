"""One run point: a trace sent to a live stack, summarized into the JSON line BENCHMARKS.md asks for."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.client import RequestRecord, run_trace
from bench.metrics import ServerSampler, summarize
from bench.workload import TraceRequest, make_trace


@dataclass
class PointSpec:
    setting: str  # S1, S2, S4, S-GQA (or "tiny" in tests)
    system: str  # loraplex, base-only, peft, merge, bmm, no-unify
    n_adapters: int
    alpha: float
    req_rate: float  # requests/s offered
    cv: float
    policy: str  # the scheduler's admission policy the stack runs (fcfs, lcfs, early-abort, ...)
    duration_s: float  # arrivals span [0, duration_s)
    warmup_s: float  # requests arriving before this are not measured
    seed: int
    prompt_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)

    def __post_init__(self):
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s): got warmup_s={self.warmup_s}, "
                             f"duration_s={self.duration_s}")

    def trace(self) -> list[TraceRequest]:
        return make_trace(self.n_adapters, self.alpha, self.req_rate, self.cv, self.duration_s, self.seed,
                          self.prompt_range, self.output_range)


def _first_gpu(query: str) -> str | None:
    """`nvidia-smi --query-gpu=QUERY` of the first GPU the stacks see (None without one). Asked of nvidia-smi,
    not torch.cuda: a CUDA context in the driver would hold GPU memory that every later stack sizes its
    pool without (the ceilings are measured in a child process for the same reason)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi is None or visible == "":
        return None
    index = (visible or "0").split(",")[0].strip()
    try:
        res = subprocess.run([smi, "-i", index, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True)
        return res.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):  # a broken driver must not lose a finished run
        return None


def gpu_name() -> str:
    """The device the bench host measures on: the name of its first visible GPU, else "cpu"."""
    return _first_gpu("name") or "cpu"


REPO = Path(__file__).resolve().parent.parent
SERVER_PACKAGES = ("services", "shared")


def code_fingerprint(root: Path) -> str | None:
    """A fingerprint of the server's source under `root` (every .py under services/ and shared/, by path and
    content): two lines with the same one were served by the same code, wherever it ran (a GPU host's copy has
    no git history). None where the packages are absent."""
    files = sorted(f for pkg in SERVER_PACKAGES for f in (root / pkg).rglob("*.py") if "__pycache__" not in f.parts)
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@functools.cache
def server_code() -> str | None:
    """This checkout's fingerprint: the stacks a sweep starts run the packages beside bench/."""
    return code_fingerprint(REPO)


def versions() -> dict:
    """torch, triton and NVIDIA driver versions of the bench host (None where absent), and the server code's
    fingerprint."""
    out: dict = {"torch_version": None, "triton_version": None, "driver_version": _first_gpu("driver_version"),
                 "server_code": server_code()}
    try:
        import torch

        out["torch_version"] = torch.__version__
    except ImportError:
        pass
    try:
        import triton

        out["triton_version"] = triton.__version__
    except ImportError:
        pass
    return out


def write_records(path: Path, records: list[RequestRecord]) -> None:
    """The per-request records of a point as JSON lines (for re-analysis; the point line is the summary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


class PointOverran(Exception):
    """A point still had requests in flight at its `max_wall_s`: they were given up, and it has no line."""

    def __init__(self, wall_s: float):
        super().__init__(f"requests still in flight after {wall_s:.0f} s")
        self.wall_s = wall_s


async def arun_point(base_url: str, spec: PointSpec, model_for: Callable[[TraceRequest], str], vocab_size: int,
                     command: str | None = None, api_key: str | None = None, slo_s: float = 6.0,
                     request_timeout_s: float = 600.0, progress: bool = True, processes: int | None = None,
                     sample_interval_s: float = 0.5, records_path: Path | None = None,
                     max_wall_s: float | None = None) -> dict:
    """Run `spec`'s trace against the stack at `base_url` (which already serves `spec.system` with its
    adapters registered) and return the point's JSON-line dict. `roofline_fraction` is None: the caller
    fills it through bench/roofline.py. `command` is the command line that produced the point (default:
    this process's own, shell-quoted). With `max_wall_s`, requests still unanswered that long after the
    start are given up (their connections closed, so the server drops them) and PointOverran is raised:
    a driver's piece ends on time even when a slow system's queue would take minutes to drain."""
    trace = spec.trace()
    started = datetime.datetime.now(datetime.timezone.utc)
    t = time.monotonic()
    sampler = ServerSampler(base_url, interval_s=sample_interval_s, api_key=api_key).start()
    try:
        records = await asyncio.wait_for(
            run_trace(base_url, trace, model_for, vocab_size, api_key=api_key, request_timeout_s=request_timeout_s,
                      progress=progress, seed=spec.seed, processes=processes), max_wall_s)
    except asyncio.TimeoutError:
        raise PointOverran(time.monotonic() - t) from None
    finally:
        server = sampler.stop()
    wall_s = time.monotonic() - t
    if records_path is not None:
        write_records(Path(records_path), records)
    point = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()}
    point.update(n_requests=len(trace), offered_rps=len(trace) / spec.duration_s)
    figures = summarize(records, spec.warmup_s, slo_s=slo_s, duration_s=spec.duration_s)
    point.update(figures)
    point.update(server)
    # Arrivals count from the trace's start, a few milliseconds after `t`: the window's busy share and steps
    # are read over [t + warmup, t + warmup + window], the same span the throughput divides by.
    window_lo = t + spec.warmup_s
    point.update(sampler.busy_within(window_lo, window_lo + figures["window_s"]))
    point.update(sampler.steps_within(window_lo, window_lo + figures["window_s"]))
    point.update(roofline_fraction=None, gpu=gpu_name(), **versions(), date=started.date().isoformat(),
                 started_at=started.isoformat(timespec="seconds"), wall_s=wall_s,
                 command=command if command is not None else shlex.join(sys.argv))
    return point


def run_point(base_url: str, spec: PointSpec, model_for: Callable[[TraceRequest], str], vocab_size: int,
              **kwargs) -> dict:
    """arun_point from synchronous code (not from inside a running event loop)."""
    return asyncio.run(arun_point(base_url, spec, model_for, vocab_size, **kwargs))
