"""The scheduler or the adapter_store killed with SIGKILL under load.

The launcher restarts it; registrations are intact (Redis and the blob store outlive it); every request the
gateway held ends cleanly within a bound (an error event or a 503, never a hang) and requests sent during
the outage are refused or served, never stuck. After a scheduler restart the worker drops the requests the
dead scheduler had assigned (nobody would receive their tokens) instead of computing them to the end.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from shared.probes import alive, metric
from tests.reliability.conftest import (
    Outcome,
    body,
    idle_without_leaks,
    join_all,
    make_stack,
    plain_request,
    ready,
    running,
    start_threads,
    stream_request,
    wait_for,
)

MAX_RUNNING = 4
PEER_TIMEOUT_S = 3.0  # the gateway's default: a scheduler silent this long has its requests failed


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running(make_stack(tmp_path_factory, "control-plane", "--demo-adapters", "3",
                            "--set", f"worker.max_running_requests={MAX_RUNNING}",
                            "--set", "scheduler.first_token_slo_s=0",
                            # The scheduler test stops the worker while the scheduler restarts.
                            "--heartbeat-timeout-s", "60")) as s:
        yield s


def registrations(stack) -> dict[str, tuple]:
    with stack.client() as c:
        r = c.get("/v1/adapters")
        assert r.status_code == 200, r.text
        return {a["name"]: (a["id"], a["sha256"], a["rank"]) for a in r.json()["data"]}


def restarted(stack, service: str, old_pid: int, timeout_s: float = 60.0) -> int:
    pid = wait_for(lambda: (p := stack.service_pids().get(service)) and p != old_pid and ready(stack) and p, timeout_s)
    assert pid, f"{service} was not restarted, or the stack did not become ready again"
    assert not alive(old_pid)
    return pid


def load(stack, streaming: int, queued: int, model: str = "model"):
    """`streaming` long requests running (each has streamed a token) and `queued` short ones behind them."""
    outs = [Outcome() for _ in range(streaming)]
    first = [threading.Event() for _ in range(streaming)]
    threads = start_threads(streaming, stream_request, lambda i: (stack.url, body(i, model=model), outs[i], first[i]))
    assert all(e.wait(60) for e in first), "the streaming requests never started"
    waiting = [Outcome() for _ in range(queued)]
    threads += start_threads(queued, plain_request, lambda i: (stack.url, body(50 + i, max_tokens=4), waiting[i]))
    assert wait_for(lambda: metric(stack.metrics(), "loraplex_queue_depth") == queued, 10)
    return outs, waiting, threads


def test_scheduler_sigkill_fails_requests_cleanly_and_the_worker_drops_its_orphans(stack):
    idle_without_leaks(stack)
    before = registrations(stack)
    old_pid = stack.service_pids()["scheduler"]
    streaming, queued, threads = load(stack, MAX_RUNNING, 2)

    # The worker is held still until the new scheduler is up, so its requests are still running when it
    # reports them there (a fast CPU could otherwise finish them during the restart: nothing left to drop).
    worker = stack.service_pids()["worker-0"]
    schedulers_up = stack.log().count("scheduler ready")
    os.kill(worker, signal.SIGSTOP)
    try:
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # A request sent during the outage is refused or fails cleanly too, never left waiting.
        during = Outcome()
        threads.append(threading.Thread(target=plain_request, args=(stack.url, body(99, max_tokens=4), during),
                                        daemon=True))
        threads[-1].start()
        assert wait_for(lambda: stack.log().count("scheduler ready") > schedulers_up, 30), "no new scheduler"
    finally:
        os.kill(worker, signal.SIGCONT)

    bound_s = PEER_TIMEOUT_S + 3.0
    join_all(threads, bound_s + 5)
    for out in streaming:
        assert out.status == 200 and out.done and out.terminals == ["error"], out
        assert out.ended - killed_at < bound_s
    for out in queued + [during]:
        assert out.error is None and out.ended - killed_at < bound_s, out
        if out.status != 200:  # queued ones cannot be replayed: the new scheduler never heard of them
            assert out.status == 503 and out.body["error"]["message"], (out.status, out.body)

    restarted(stack, "scheduler", old_pid)
    assert registrations(stack) == before
    # The new scheduler aborts what its predecessor had assigned as soon as the worker reports on it: the
    # worker drops each of those requests (never computing them to their LONG-token end for nobody).
    idle_without_leaks(stack, timeout_s=30)
    log = stack.log()
    assert "orphaned requests aborted on worker" in log
    for out in streaming:
        rid = out.events[0]["id"]
        assert any("worker.aborted" in line and rid in line for line in log.splitlines()), f"{rid} was not dropped"
    with stack.client() as c:
        for model in ("model", "demo-000"):
            r = c.post("/v1/completions", json=body(3, max_tokens=5, stream=False, model=model))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    idle_without_leaks(stack)


def test_store_sigkill_keeps_registrations_and_requests_never_hang(stack):
    idle_without_leaks(stack)
    before = registrations(stack)
    old_pid = stack.service_pids()["adapter_store"]
    # Adapter requests running (their adapter resident in the worker's pool) when the store dies.
    cancel = threading.Event()
    streaming = [Outcome() for _ in range(2)]
    first = [threading.Event() for _ in range(2)]
    threads = start_threads(2, stream_request, lambda i: (stack.url, body(i, model="demo-001"), streaming[i], first[i],
                                                          120.0, cancel))
    assert all(e.wait(60) for e in first), "the streaming requests never started"

    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # During the outage: the base model needs no store; an adapter the gateway has to look up waits for the
    # restarted store or is refused, within a bound.
    during = [Outcome() for _ in range(3)]
    models = ["model", "demo-001", "demo-002"]
    late = start_threads(3, plain_request, lambda i: (stack.url, body(60 + i, max_tokens=4, model=models[i]), during[i]))
    join_all(late, 60)
    for out in during:
        assert out.error is None, out
        assert out.status in (200, 503), (out.status, out.body)
        if out.status == 200:
            assert out.body["usage"]["completion_tokens"] == 4
        else:
            assert out.body["error"]["message"]
    assert during[0].status == 200, "the base model does not need the store"

    restarted(stack, "adapter_store", old_pid)
    assert time.monotonic() - killed_at < 60
    assert registrations(stack) == before
    # The running adapter requests never needed the store again: still streaming, or done, never failed.
    assert all(out.terminals in ([], ["length"]) for out in streaming), streaming
    cancel.set()
    join_all(threads, 30)
    with stack.client() as c:
        for model in models + ["demo-000"]:
            r = c.post("/v1/completions", json=body(4, max_tokens=5, stream=False, model=model))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, (model, r.text)
    # Pins taken from the new store are all given back; the old process's pins died with it.
    idle_without_leaks(stack)
