"""Soak test: steady load at a fraction of measured capacity against a launched stack, with connections
dropped at random, for N minutes; then check that nothing leaked.

    python scripts/soak.py --minutes 30 --out soak.json

1) start   `loraplex up` (CPU, tiny model, demo adapters) in a fresh data dir, on a free port
2) warm    every model once, then measure capacity: completed requests per second with the worker's batch
           kept full (closed loop, twice its running limit in flight)
3) baseline after the stack is idle: RSS of each service, free pool slots, arena bytes and pins
4) soak    Poisson arrivals at --load x capacity; each request picks a model, a prompt, a length, streaming
           or not; --drop of them have their connection closed at a random moment. Greedy outputs are
           compared with the first answer seen for the same (model, prompt, length): a mismatch is an error.
           In-flight requests are capped (--max-outstanding): when the machine slows down, arrivals wait
           instead of piling into the server's queue (counted as `held_back`).
5) settle  wait until idle, then compare with the baseline: free slots and arena figures equal, RSS within
           --rss-tolerance-mb, errors zero. Progress every --progress-s seconds; a JSON summary at the end.

Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.ports import free_port
from shared.probes import metric, rss_mb, service_pids

REPO = Path(__file__).resolve().parents[1]
BASE_MODEL = "model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="length of the steady-load phase")
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of measured capacity")
    p.add_argument("--drop", type=float, default=0.1, help="fraction of requests whose connection is dropped")
    p.add_argument("--capacity-s", type=float, default=20.0, help="length of the capacity measurement")
    p.add_argument("--max-running", type=int, default=16, help="worker.max_running_requests of the stack")
    p.add_argument("--max-outstanding", type=int, default=64, help="requests in flight from this client at most")
    p.add_argument("--demo-adapters", type=int, default=4, help="adapters served besides the base model")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0, help="RSS growth per service still counted as baseline")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--settle-s", type=float, default=60.0, help="time the stack gets to return to idle at the end")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the stack (0 = leave as is): on a small shared machine, idle intra-op "
                        "threads spinning against other processes cost more than they give to a tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="", help="stack data dir (default: a fresh temporary folder)")
    p.add_argument("--out", default="soak.json", help="JSON summary written here")
    p.add_argument("--set", action="append", default=[], metavar="SERVICE.FLAG=VALUE", help="extra stack flag")
    return p.parse_args(argv)


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# ---- the stack ----------------------------------------------------------------------------------------

class Stack:
    def __init__(self, data_dir: Path, args: argparse.Namespace):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.torch_threads = args.torch_threads
        self.log_path = data_dir.parent / f"soak-stack-{self.port}.log"
        self.extra = ["--demo-adapters", str(args.demo_adapters),
                      "--set", f"worker.max_running_requests={args.max_running}",
                      "--set", "scheduler.first_token_slo_s=0", "--set", "scheduler.max_queue=4096"]
        for item in args.set:
            self.extra += ["--set", item]

    def start(self, timeout_s: float = 300.0) -> None:
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - the stack writes to it until stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.torch_threads)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", "--device", "cpu", "--data-dir", str(self.data_dir),
             "--port", str(self.port), *self.extra],
            cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "loraplex.ready" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stack did not start; see {self.log_path}")
            time.sleep(0.2)

    def services(self) -> dict[str, int]:
        return service_pids(self.proc.pid)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log_file.close()
        return self.proc.returncode


@dataclass
class Snapshot:
    """What must come back to the same figures once the stack is idle again."""

    rss_mb: dict[str, float]
    free_slots: float
    adapter_slots: float
    kv_slots: float
    arena_used_bytes: float
    arena_pinned_bytes: float
    arena_pins: float
    resident_gpu: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


async def idle_snapshot(client: httpx.AsyncClient, stack: Stack, timeout_s: float) -> Snapshot | None:
    """Once nothing runs or waits, no KV slot is held and no arena pin is left (a worker pins an adapter
    only while it reads its bytes), take the figures; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        values = {
            "running": metric(text, "loraplex_running_requests", worker="worker-0"),
            "queued": metric(text, "loraplex_queue_depth"),
            "kv": metric(text, "loraplex_pool_slots", worker="worker-0", kind="kv"),
            "pins": metric(text, "loraplex_arena_pins"),
            "resident": metric(text, "loraplex_adapters_resident", tier="gpu"),
        }
        if values["running"] == 0 and values["queued"] == 0 and values["kv"] == 0 and values["pins"] == 0:
            return Snapshot(
                rss_mb={name: rss_mb(pid) or 0.0 for name, pid in sorted(stack.services().items())},
                free_slots=metric(text, "loraplex_pool_slots", worker="worker-0", kind="free"),
                adapter_slots=metric(text, "loraplex_pool_slots", worker="worker-0", kind="adapter"),
                kv_slots=values["kv"],
                arena_used_bytes=metric(text, "loraplex_arena_bytes", kind="used"),
                arena_pinned_bytes=metric(text, "loraplex_arena_bytes", kind="pinned"),
                arena_pins=values["pins"], resident_gpu=values["resident"])
        await asyncio.sleep(0.5)
    return None


# ---- load ---------------------------------------------------------------------------------------------

@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    dropped: int = 0  # closed on purpose by this client
    held_back: int = 0  # arrivals that waited for the outstanding cap
    errors: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    latencies: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @property
    def error_count(self) -> int:
        return sum(self.errors.values()) + self.mismatches


class Load:
    """Requests of a fixed menu, so greedy answers repeat and can be compared over the whole run."""

    def __init__(self, models: list[str], seed: int):
        self.rng = random.Random(seed)
        self.models = models
        self.prompts = [[1] + [self.rng.randrange(3, 250) for _ in range(self.rng.randrange(3, 48))] for _ in range(12)]
        self.lengths = [4, 12, 24, 40]
        self.expected: dict[tuple, str] = {}

    def pick(self) -> tuple[tuple, dict, bool]:
        model = self.rng.choice(self.models)
        p = self.rng.randrange(len(self.prompts))
        n = self.rng.choice(self.lengths)
        stream = self.rng.random() < 0.5
        body = {"model": model, "prompt": self.prompts[p], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        return (model, p, n), body, stream

    def check(self, key: tuple, text: str, tally: Tally) -> None:
        first = self.expected.setdefault(key, text)
        if first != text:
            tally.mismatches += 1
            say("MISMATCH", key, repr(first[:40]), repr(text[:40]))


async def one_request(client: httpx.AsyncClient, load: Load, tally: Tally, drop_after: float | None) -> None:
    key, body, stream = load.pick()
    started = time.monotonic()
    tally.sent += 1
    try:
        if drop_after is not None:
            # Close the connection at a random moment: the gateway must abort the request everywhere.
            try:
                await asyncio.wait_for(_send(client, body, stream), drop_after)
            except TimeoutError:
                tally.dropped += 1
                return
        else:
            status, text = await _send(client, body, stream)
            if status != 200:
                tally.error(f"http_{status}")
                return
            load.check(key, text, tally)
        tally.ok += 1
        tally.latencies.append(time.monotonic() - started)
    except httpx.HTTPError as e:
        tally.error(type(e).__name__)


async def _send(client: httpx.AsyncClient, body: dict, stream: bool) -> tuple[int, str]:
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, r.text
        data = r.json()
        return (200 if data["choices"][0]["finish_reason"] == "length" else 599), data["choices"][0]["text"]
    pieces, finish, done = [], None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return 598, event["error"]["message"]
                pieces.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
    return (200 if done and finish == "length" else 597), "".join(pieces)


async def measure_capacity(client: httpx.AsyncClient, load: Load, seconds: float, concurrency: int) -> float:
    tally = Tally()
    stop_at = time.monotonic() + seconds

    async def loop():
        while time.monotonic() < stop_at:
            await one_request(client, load, tally, None)

    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    if tally.error_count:
        raise RuntimeError(f"errors while measuring capacity: {tally.errors} mismatches={tally.mismatches}")
    return tally.ok / (time.monotonic() - started)


async def steady_load(client: httpx.AsyncClient, load: Load, tally: Tally, rate: float, seconds: float,
                      drop: float, max_outstanding: int, progress_s: float, stack: Stack, mean_latency: float) -> None:
    rng = random.Random(load.rng.random())
    outstanding = asyncio.Semaphore(max_outstanding)
    tasks: set[asyncio.Task] = set()
    started = time.monotonic()
    next_progress = started + progress_s
    next_arrival = started
    while (now := time.monotonic()) < started + seconds:
        if now >= next_progress:
            next_progress += progress_s
            lat = sorted(tally.latencies[-2000:])
            p50 = lat[len(lat) // 2] if lat else 0.0
            rss = {k: round(v or 0) for k, v in ((n, rss_mb(p)) for n, p in stack.services().items())}
            say(f"t={now - started:6.0f}s sent={tally.sent} ok={tally.ok} dropped={tally.dropped} "
                f"errors={tally.error_count} in_flight={len(tasks)} held_back={tally.held_back} p50={p50:.2f}s rss_mb={rss}")
        if now < next_arrival:
            await asyncio.sleep(min(next_arrival - now, 0.05))
            continue
        next_arrival += rng.expovariate(rate)
        if outstanding.locked():
            tally.held_back += 1
        await outstanding.acquire()
        drop_after = rng.uniform(0.0, mean_latency) if rng.random() < drop else None
        task = asyncio.create_task(one_request(client, load, tally, drop_after))
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), outstanding.release()))
    if tasks:
        await asyncio.gather(*tasks)


# ---- main ---------------------------------------------------------------------------------------------

async def run(args: argparse.Namespace, stack: Stack, summary: dict) -> bool:
    limits = httpx.Limits(max_connections=args.max_outstanding + 2 * args.max_running + 8)
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        models = [BASE_MODEL] + [f"demo-{i:03d}" for i in range(args.demo_adapters)]
        load = Load(models, args.seed)
        say("warming up every model")
        for model in models:
            body = {"model": model, "prompt": load.prompts[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            (await client.post("/v1/completions", json=body)).raise_for_status()
        say(f"measuring capacity for {args.capacity_s:g}s at concurrency {2 * args.max_running}")
        capacity = await measure_capacity(client, load, args.capacity_s, 2 * args.max_running)
        rate = args.load * capacity
        summary.update(capacity_rps=round(capacity, 3), target_rps=round(rate, 3))
        say(f"capacity {capacity:.2f} req/s; soak at {rate:.2f} req/s for {args.minutes:g} min")
        baseline = await idle_snapshot(client, stack, args.settle_s)
        if baseline is None:
            summary["failure"] = "the stack did not become idle before the soak"
            return False
        summary["baseline"] = baseline.as_dict()
        say("baseline", json.dumps(baseline.as_dict()))

        tally = Tally()
        # Mean latency at this load is about a batch's worth of decode; drops land before, during and after it.
        mean_latency = max(0.05, args.max_running / capacity)
        soak_started = time.monotonic()
        await steady_load(client, load, tally, rate, args.minutes * 60, args.drop, args.max_outstanding,
                          args.progress_s, stack, mean_latency)
        elapsed = time.monotonic() - soak_started
        final = await idle_snapshot(client, stack, args.settle_s)
        lat = sorted(tally.latencies)
        summary.update(
            soak_s=round(elapsed, 1), sent=tally.sent, ok=tally.ok, dropped=tally.dropped, held_back=tally.held_back,
            errors=tally.errors, error_count=tally.error_count, mismatches=tally.mismatches,
            achieved_rps=round(tally.sent / elapsed, 3),
            latency_s={"p50": round(lat[len(lat) // 2], 3) if lat else None,
                       "p99": round(lat[int(len(lat) * 0.99)], 3) if lat else None},
        )
        text = (await client.get("/metrics")).text
        summary["client_disconnect_aborts"] = metric(text, "loraplex_aborts_total", reason="client_disconnect")
        if final is None:
            summary["failure"] = f"the stack did not return to idle within {args.settle_s:g}s"
            return False
        summary["final"] = final.as_dict()
        checks = {
            "errors_zero": tally.error_count == 0,
            "free_slots_back": final.free_slots + final.adapter_slots == baseline.free_slots + baseline.adapter_slots,
            "kv_slots_zero": final.kv_slots == 0,
            "arena_pins_zero": final.arena_pins == 0,
            "arena_used_back": final.arena_used_bytes == baseline.arena_used_bytes,
            "rss_back": all(final.rss_mb.get(k, 0) - v <= args.rss_tolerance_mb for k, v in baseline.rss_mb.items()),
            "same_processes": set(final.rss_mb) == set(baseline.rss_mb),
        }
        summary["rss_growth_mb"] = {k: round(final.rss_mb.get(k, 0) - v, 1) for k, v in baseline.rss_mb.items()}
        summary["checks"] = checks
        return all(checks.values())


def _interrupted(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through main's cleanup: the stack is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    tmp = None
    if args.data_dir:
        data_dir = Path(args.data_dir).resolve()
    else:
        tmp = tempfile.TemporaryDirectory(prefix="loraplex-soak-")
        data_dir = Path(tmp.name) / "data"
    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": f"{platform.node()} {platform.machine()} "
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else "soak.main(" + " ".join(argv) + ")",
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
    }
    stack = Stack(data_dir, args)
    say(f"starting the stack in {data_dir} (log {stack.log_path})")
    stack.start()
    passed = False
    try:
        summary["services"] = stack.services()
        passed = asyncio.run(run(args, stack, summary))
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - whatever failed, the summary says it and the stack stops
        summary["failure"] = f"{type(e).__name__}: {e}"
    finally:
        summary["stack_exit_code"] = stack.stop()
        passed = passed and summary["stack_exit_code"] == 0
        summary["passed"] = passed
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        say("PASSED" if passed else "FAILED", json.dumps({k: summary.get(k) for k in
            ("sent", "ok", "dropped", "error_count", "checks", "rss_growth_mb", "failure")}))
        if tmp is not None:
            tmp.cleanup()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
