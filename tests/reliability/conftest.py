"""Fixtures and helpers of the reliability tests: real `loraplex up` stacks (tests.e2e's Stack), every wait
bounded, and the checks that prove nothing leaked once a stack is idle again."""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from shared.probes import metric
from tests.e2e.conftest import Stack as E2EStack


class Stack(E2EStack):
    """tests.e2e's launched stack, its services on one intra-op thread each: the tiny model gains nothing
    from more, and on a small shared machine idle threads spinning against the other processes cost a
    request several times its time (measured: 27 ms against 92 ms for 8 tokens)."""

    def start(self, timeout_s: float = 180.0) -> Stack:
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the launcher, and by every child it (re)starts
        try:
            return super().start(timeout_s)
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved


# Tokens: the most a 4-token prompt may ask for in the tiny model's 2048 positions. Alone on one CPU thread
# that is ~3.5 s; tests that need a request to outlive a fault run several of them.
LONG = 2044


def body(i: int, max_tokens: int = LONG, stream: bool = True, model: str = "model") -> dict:
    return {"model": model, "prompt": [1, 9 + i % 50, 77, 78], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def wait_for(pred, timeout_s: float, period_s: float = 0.05):
    """pred()'s first truthy value, or None after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(period_s)


def ready(stack: Stack) -> bool:
    try:
        with stack.client(timeout=5) as c:
            return c.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False


def idle_without_leaks(stack: Stack, workers: tuple[str, ...] = ("worker-0",), timeout_s: float = 60.0) -> str:
    """Metrics once the stack is idle, asserting nothing leaked: no request running or queued anywhere,
    no KV slot held, every pool slot free or holding an adapter, the gateway holding no request, and no pin
    left in the arena (a worker keeps one only while it reads an adapter's bytes: staged for admission or
    being copied into its pool; a request that ended without releasing its adapter would leave one)."""
    last: dict = {}

    def settled():
        text = stack.metrics()
        values = {"queued": metric(text, "loraplex_queue_depth"),
                  "gateway_in_flight": metric(text, "loraplex_gateway_in_flight"),
                  "pins": metric(text, "loraplex_arena_pins"),
                  "resident": metric(text, "loraplex_adapters_resident", tier="gpu")}
        for w in workers:
            values[f"{w}.running"] = metric(text, "loraplex_running_requests", worker=w)
            values[f"{w}.waiting"] = metric(text, "loraplex_worker_waiting_requests", worker=w)
            values[f"{w}.kv"] = metric(text, "loraplex_pool_slots", worker=w, kind="kv")
            total = metric(text, "loraplex_pool_slots", worker=w, kind="total")
            free = metric(text, "loraplex_pool_slots", worker=w, kind="free")
            adapter = metric(text, "loraplex_pool_slots", worker=w, kind="adapter")
            values[f"{w}.lost_slots"] = None if total is None else total - free - adapter
        last.clear()
        last.update(values)
        zero = [k for k in values if k not in ("pins", "resident")]
        pins_ok = values["pins"] == 0
        return text if all(values[k] == 0 for k in zero) and pins_ok else None

    text = wait_for(settled, timeout_s, 0.25)
    assert text, f"the stack did not settle without leaks within {timeout_s}s: {last}"
    return text


@dataclass
class Outcome:
    """What one HTTP request got, read to its end."""

    status: int | None = None
    events: list = field(default_factory=list)  # SSE data payloads (parsed), [DONE] excluded
    done: bool = False
    body: dict | None = None
    started: float = 0.0
    first_token: float | None = None
    ended: float | None = None
    error: str | None = None  # transport error
    headers: dict = field(default_factory=dict)  # of the response

    @property
    def terminals(self) -> list[str]:
        """Every terminal answer the request got: finish reasons and error events (one expected)."""
        out = []
        for e in self.events:
            if "after_done" in e:
                out.append("event after [DONE]")
            elif "error" in e:
                out.append("error")
            else:
                out += [c["finish_reason"] for c in e.get("choices", []) if c.get("finish_reason")]
        return out

    @property
    def completion_tokens(self) -> int | None:
        """From the usage chunk (streams are sent with include_usage)."""
        usage = [e["usage"] for e in self.events if e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None


def stream_request(url: str, payload: dict, out: Outcome, first_token: threading.Event | None = None,
                   timeout_s: float = 120.0, cancel: threading.Event | None = None, headers: dict | None = None) -> None:
    """POST a streaming completion and record everything it answers (run in a thread). Setting `cancel`
    closes the connection at the next event, which aborts the request."""
    out.started = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=timeout_s, headers=headers or {}) as c:
            payload = {"stream_options": {"include_usage": True}, **payload, "stream": True}
            with c.stream("POST", "/v1/completions", json=payload) as r:
                out.status, out.headers = r.status_code, dict(r.headers)
                if r.status_code != 200:
                    r.read()
                    out.body = r.json()
                    return
                for line in r.iter_lines():
                    if cancel is not None and cancel.is_set():
                        return
                    if line == "data: [DONE]":
                        out.done = True
                    elif line.startswith("data: "):
                        if out.done:
                            out.events.append({"after_done": line})
                            continue
                        event = json.loads(line[6:])
                        out.events.append(event)
                        if out.first_token is None and "error" not in event:
                            out.first_token = time.monotonic()
                            if first_token is not None:
                                first_token.set()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.ended = time.monotonic()


def plain_request(url: str, payload: dict, out: Outcome, timeout_s: float = 120.0, headers: dict | None = None) -> None:
    out.started = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=timeout_s, headers=headers or {}) as c:
            r = c.post("/v1/completions", json={**payload, "stream": False})
            out.status, out.headers = r.status_code, dict(r.headers)
            out.body = r.json()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.ended = time.monotonic()


def start_threads(n: int, target, args_of) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=args_of(i), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"requests still open {timeout_s}s later: a request hung"


@contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    """The stack started, then stopped, and whatever it left killed, however the test ends."""
    try:
        yield stack.start()
    finally:
        stack.stop()
        stack.kill_everything()


def make_stack(tmp_path_factory, name: str, *args: str) -> Stack:
    root = tmp_path_factory.mktemp(name)
    return Stack(root / "data", *args)


@pytest.fixture
def stack_factory(tmp_path_factory):
    """Start stacks that the test may damage; every one is stopped (or killed) afterwards."""
    with ExitStack() as started:
        yield lambda name, *args: started.enter_context(running(make_stack(tmp_path_factory, name, *args)))


GENERAL_MAX_RUNNING = 8
GENERAL_UPLOAD_CAP = 2_000_000


@pytest.fixture(scope="session")
def general_allowed_root(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability-allowed-root")


@pytest.fixture(scope="session")
def general_stack(tmp_path_factory, general_allowed_root):
    """One stack for the tests that leave it serving (cancel storms, hostile input, fuzzing): demo adapters,
    a 2 MB upload cap and path registration under general_allowed_root."""
    with running(make_stack(tmp_path_factory, "reliability-general", "--demo-adapters", "2",
                            "--allowed-root", str(general_allowed_root),
                            "--set", f"worker.max_running_requests={GENERAL_MAX_RUNNING}",
                            "--set", f"gateway.max_upload_bytes={GENERAL_UPLOAD_CAP}",
                            "--set", f"store.max_upload_bytes={GENERAL_UPLOAD_CAP}",
                            "--set", "scheduler.first_token_slo_s=0")) as s:
        yield s
