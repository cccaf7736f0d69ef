"""SIGTERM to the launcher under load: requests that arrive during the drain get 503, every request in
flight (running or still queued) finishes within the drain timeout, one that cannot finish in time ends
with a clean error event when the timeout expires, and every child process exits."""
from __future__ import annotations

import signal
import threading
import time

import httpx

from shared.probes import descendants
from tests.e2e.conftest import wait_gone
from tests.reliability.conftest import (
    LONG,
    Outcome,
    body,
    join_all,
    make_stack,
    plain_request,
    running as running_stack,
    start_threads,
    stream_request,
    wait_for,
)

RUNNING = 5  # streaming when SIGTERM arrives: 2 that finish in time, 3 that cannot (LONG tokens each)
FINISHING = 2
QUEUED = 3  # still in the scheduler's queue then


def drain_timeout(per_token: float) -> float:
    """A drain the LONG requests cannot outlast on this machine: a third of their run (a fast CPU decodes
    LONG tokens in ~4 s, a loaded one takes several times that), between 1.5 and 5 s."""
    return max(1.5, min(5.0, LONG * per_token / 3))


def time_per_token(stack) -> float:
    """Seconds per decode step with a full batch, from a timed batch of 32-token requests."""
    outs = [Outcome() for _ in range(RUNNING)]
    threads = start_threads(RUNNING, stream_request, lambda i: (stack.url, body(60 + i, max_tokens=32), outs[i]))
    join_all(threads, 120)
    assert all(o.status == 200 and o.completion_tokens == 32 for o in outs), outs
    return max(o.ended - o.first_token for o in outs) / 31


def test_sigterm_under_load_refuses_new_requests_finishes_in_flight_ones_and_exits(tmp_path_factory, stack_factory):
    # The drain timeout is the launcher's from its start, and it must be short of what the LONG requests
    # need on this machine: sized from a timed batch of the same shape on a stack of the same settings.
    settings = ("--demo-adapters", "1", "--set", f"worker.max_running_requests={RUNNING}",
                "--set", "scheduler.first_token_slo_s=0")
    with running_stack(make_stack(tmp_path_factory, "drain-probe", *settings)) as probe:
        per_token = time_per_token(probe)
    drain_s = drain_timeout(per_token)
    stack = stack_factory("drain", "--drain-timeout-s", f"{drain_s:.2f}", *settings)
    children = descendants(stack.proc.pid)
    assert len(children) >= 5

    # Running requests long enough to be running still when SIGTERM comes, short enough to finish well
    # inside the drain timeout (a third of it).
    n = max(24, min(800, int(drain_s / 3 / per_token)))
    running = [Outcome() for _ in range(RUNNING)]
    first = [threading.Event() for _ in range(RUNNING)]
    tokens = [n, n + 8] + [LONG] * (RUNNING - FINISHING)
    models = ["model", "demo-000"] * 3
    threads = start_threads(RUNNING, stream_request,
                            lambda i: (stack.url, body(i, max_tokens=tokens[i], model=models[i]), running[i], first[i]))
    assert all(e.wait(60) for e in first), "the requests never started"
    queued = [Outcome() for _ in range(QUEUED)]
    threads += start_threads(QUEUED, plain_request, lambda i: (stack.url, body(20 + i, max_tokens=16), queued[i]))
    with stack.client() as c:
        assert wait_for(lambda: "loraplex_queue_depth 3.0" in c.get("/metrics").text, 10), "requests were not queued"

    stack.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # New requests during the drain: 503 with an error body once the gateway has the signal (the launcher
    # passes it on within its supervision period), until the gateway stops listening.
    answers = []
    while time.monotonic() - signalled < drain_s and sum(r.status_code == 503 for r in answers) < 5:
        try:
            with stack.client(timeout=5) as c:
                answers.append(c.post("/v1/completions", json=body(40, max_tokens=2, stream=False)))
        except httpx.TransportError:
            break  # the gateway is gone: nothing can be accepted any more
        time.sleep(0.1)
    statuses = [r.status_code for r in answers]
    assert 503 in statuses, statuses
    accepted_before = statuses.index(503)
    assert set(statuses[accepted_before:]) == {503}, statuses
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in answers[:accepted_before])
    for r in answers[accepted_before:]:
        assert r.json()["error"]["message"] and r.headers.get("retry-after")

    join_all(threads, drain_s + 10)
    for out, n in zip(running[:FINISHING] + queued, tokens[:FINISHING] + [16] * QUEUED):
        assert out.error is None and out.status == 200, out
        if out.body is not None:  # a queued (non-streaming) request
            assert out.body["usage"]["completion_tokens"] == n and out.body["choices"][0]["finish_reason"] == "length"
        else:
            assert out.done and out.terminals == ["length"] and out.completion_tokens == n, out
        assert out.ended - signalled < drain_s
    # Those that could not finish: exactly one terminal answer each, an error, when the drain timed out.
    for cut in running[FINISHING:]:
        assert cut.status == 200 and cut.error is None and cut.done and cut.terminals == ["error"], cut
        assert drain_s - 1 < cut.ended - signalled < drain_s + 5

    assert stack.proc.wait(drain_s + 30) == 0
    assert wait_gone(children, 10) == [], "children outlived the drain"
