"""Runs a benchmark plan: named steps, each a shell command with a time cap, in order, under one wall-clock
deadline, so that a GPU session of fixed length measures as much of the plan as fits and keeps every result
written before the end (a step cut off by its cap keeps whatever it wrote; later steps still run).

    python -m benchmarks.run_plan benchmarks/plans/few_adapter_graphs.yaml --out $OUT/few --deadline-s 1400 --pack

A plan (YAML):

    steps:
      - name: ab_sgqa_b512_n5            # its log is OUT/NAME.log
        cap_s: 150                       # killed (with its children) after this long
        run: python3 benchmarks/decode_ab.py ... --out {out}/ab.json
      - name: served_sgqa_n5
        min_s: 330                       # skipped unless this much of the deadline is left
        gpu: H200                        # skipped unless the first GPU's name holds this (a target GPU's point)
        run: loraplex bench sweep ... --since {since} --budget-s {budget}

A step's command may name {out} (the results folder), {since} (the plan's start, an ISO minute in UTC, for
`loraplex bench sweep --since`), {started} (the step's own start, to the second: `--since {started}` measures
a point again that an earlier step of the same plan measured) and {budget} (seconds the step may run: its cap,
or what is left, less a margin). Progress goes to stderr as each step starts and ends; OUT/plan.json records
each step's exit code, start and seconds, or why it was skipped, with the versions the served points' lines
carry (bench/point.py: torch, triton, NVIDIA driver, the server source's fingerprint).

With --pack the folder's files end up in one archive inside it, OUT/PLAN.tar.gz (PLAN the plan file's name), when
the plan ends or is stopped (SIGTERM, as `timeout` sends): a GPU host may hand back only a few files of a run,
and a plan writes a log a step besides its results.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench.point import gpu_name, versions

# A step gets at most what is left less this, so the plan's last writes land before the deadline.
MARGIN_S = 20
# Less time than this left is not worth a step: startup (imports, compiles) alone takes about as long.
MIN_STEP_S = 40


@dataclass(frozen=True)
class Step:
    name: str
    run: str
    cap_s: int = 600
    min_s: int = MIN_STEP_S
    gpu: str = ""  # runs only where the first GPU's name holds this ("": anywhere)


def load_plan(path: str | Path) -> list[Step]:
    """The plan's steps; a clear error naming the step and field for anything malformed."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not a YAML plan ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list) or not doc["steps"]:
        raise ValueError(f"{path}: a plan needs a non-empty list under 'steps'")
    steps, names = [], set()
    for i, raw in enumerate(doc["steps"]):
        where = f"{path}: steps[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a mapping")
        unknown = set(raw) - {"name", "run", "cap_s", "min_s", "gpu"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        name, run = raw.get("name"), raw.get("run")
        if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{where}.name must be letters, digits, '_' or '-' (it names the step's log)")
        if name in names:
            raise ValueError(f"{where}.name {name!r} is used twice")
        if not isinstance(run, str) or not run.strip():
            raise ValueError(f"{where}.run must be a command")
        for field in ("cap_s", "min_s"):
            if field in raw and (not isinstance(raw[field], int) or raw[field] <= 0):
                raise ValueError(f"{where}.{field} must be a positive whole number of seconds")
        if "gpu" in raw and (not isinstance(raw["gpu"], str) or not raw["gpu"].strip()):
            raise ValueError(f"{where}.gpu must name a GPU, as H200")
        names.add(name)
        steps.append(Step(name, run, raw.get("cap_s", 600), raw.get("min_s", MIN_STEP_S), raw.get("gpu", "")))
    return steps


@dataclass
class Outcome:
    name: str
    status: str  # "done" (rc 0), "failed", "cut off" (its cap or the deadline), "skipped"
    rc: int | None = None
    started: str | None = None
    seconds: float = 0.0
    why: str = ""


def stop_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def pack(out: Path, name: str) -> Path:
    """The folder's files into OUT/NAME.tar.gz (written whole, then put in place), then out of the folder."""
    archive = out / f"{name}.tar.gz"
    partial = out / f"{name}.tar.gz.partial"
    files = sorted(f for f in out.rglob("*") if f.is_file() and f not in (archive, partial))
    with tarfile.open(partial, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(out)))
    partial.replace(archive)
    for f in files:
        f.unlink()
    for d in sorted((d for d in out.rglob("*") if d.is_dir()), reverse=True):
        d.rmdir()
    return archive


def _stopped(signum, frame):
    raise SystemExit(128 + signum)


def run_step(step: Step, out: Path, since: str, left_s: float, gpu: str) -> Outcome:
    if step.gpu and step.gpu not in gpu:
        return Outcome(step.name, "skipped", why=f"needs a GPU named {step.gpu}; this host has {gpu}")
    if left_s - MARGIN_S < step.min_s:
        return Outcome(step.name, "skipped", why=f"{left_s:.0f} s left, the step needs {step.min_s}")
    cap = int(min(step.cap_s, left_s - MARGIN_S))
    started = dt.datetime.now(dt.timezone.utc)
    # Plain replacement, not str.format: a shell command may hold braces of its own.
    command = (step.run.replace("{out}", str(out)).replace("{since}", since)
               .replace("{started}", started.strftime("%Y-%m-%dT%H:%M:%S"))
               .replace("{budget}", str(max(cap - MARGIN_S, 1))))
    t0 = time.monotonic()
    with open(out / f"{step.name}.log", "w") as log:
        log.write(f"$ {command}\n")
        log.flush()
        # Its own session, so a step cut off takes its children (servers, compilers) down with it.
        proc = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=cap)
            status = "done" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc, status = None, "cut off"
        except BaseException:
            stop_group(proc)  # the plan itself was stopped: its step's processes go with it
            raise
    return Outcome(step.name, status, rc, started.isoformat(timespec="seconds"), round(time.monotonic() - t0, 1),
                   f"after its {cap} s cap" if status == "cut off" else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan")
    p.add_argument("--out", required=True, help="results folder (created)")
    p.add_argument("--deadline-s", type=float, required=True, help="seconds from now the whole plan must end by")
    p.add_argument("--since", default=None, help="{since} in commands (default: now, to the minute, UTC)")
    p.add_argument("--pack", action="store_true",
                   help="at the end, the folder's files as one archive in it, OUT/PLAN.tar.gz")
    args = p.parse_args()
    try:
        steps = load_plan(args.plan)
    except (OSError, ValueError) as e:
        p.error(str(e))  # before any step runs or any folder is made
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline_s
    since = args.since or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M")
    outcomes: list[Outcome] = []
    host = versions()  # torch, triton, driver, and the server source's fingerprint
    gpu = gpu_name()
    if args.pack:
        signal.signal(signal.SIGTERM, _stopped)
    try:
        for i, step in enumerate(steps, 1):
            print(f"[{i}/{len(steps)}] {step.name} ...", file=sys.stderr, flush=True)
            outcome = run_step(step, out, since, deadline - time.monotonic(), gpu)
            outcomes.append(outcome)
            print(f"[{i}/{len(steps)}] {step.name}: {outcome.status}"
                  + (f", rc {outcome.rc}" if outcome.rc is not None else "")
                  + (f" in {outcome.seconds:.0f} s" if outcome.started else "")
                  + (f" ({outcome.why})" if outcome.why else ""), file=sys.stderr, flush=True)
            # server_code ties every result of the session to the source it ran (a GPU host's copy has no history).
            (out / "plan.json").write_text(json.dumps({"plan": str(args.plan), "since": since, **host,
                                                       "steps": [asdict(o) for o in outcomes]}, indent=1))
    finally:
        if args.pack:
            print(f"packed into {pack(out, Path(args.plan).stem)}", file=sys.stderr, flush=True)
    return 0 if all(o.status == "done" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
