"""A worker that dies (SIGKILL) or hangs (SIGSTOP) mid-batch, with requests in every state: streaming,
assigned to it but silent, and queued in the scheduler.

Every in-flight request gets exactly one clean terminal answer within the bound (2 s after a SIGKILL, the
heartbeat timeout plus 2 s after a SIGSTOP): those that streamed end with an error event, those that
streamed nothing are requeued and complete on the restarted worker. /ready goes false, then true; the old
process is gone; later requests succeed; no slot, gateway request or arena pin is leaked.
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

HEARTBEAT_TIMEOUT_S = 3.0
MAX_RUNNING = 4
STREAMING = 2  # running and streaming when the worker fails
SILENT = 2  # assigned to the worker after it stopped: they never streamed
QUEUED = 1  # waiting in the scheduler (the worker is full)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running(make_stack(tmp_path_factory, "worker-faults", "--demo-adapters", "1",
                            "--heartbeat-timeout-s", f"{HEARTBEAT_TIMEOUT_S:g}",
                            "--set", f"worker.max_running_requests={MAX_RUNNING}",
                            "--set", "scheduler.first_token_slo_s=0")) as s:
        yield s


class ReadyWatch:
    """Polls /ready in the background and records each change."""

    def __init__(self, stack):
        self.stack = stack
        self.changes: list[tuple[float, bool]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            now_ready = ready(self.stack)
            if not self.changes or self.changes[-1][1] != now_ready:
                self.changes.append((time.monotonic(), now_ready))
            time.sleep(0.05)

    def saw_false_then_true(self) -> bool:
        states = [r for _, r in self.changes]
        return False in states and states[-1] is True and states.index(False) < len(states) - 1


@pytest.mark.parametrize("sig, bound_s", [(signal.SIGKILL, 2.0), (signal.SIGSTOP, HEARTBEAT_TIMEOUT_S + 2.0)],
                         ids=["sigkill", "sigstop"])
def test_failed_worker_ends_every_request_cleanly_in_time_and_leaks_nothing(stack, sig, bound_s):
    idle_without_leaks(stack)
    old_pid = stack.service_pids()["worker-0"]
    watch = ReadyWatch(stack)
    assert wait_for(lambda: watch.changes and watch.changes[-1][1], 10), "stack not ready before the fault"

    streaming = [Outcome() for _ in range(STREAMING)]
    first = [threading.Event() for _ in range(STREAMING)]
    threads = start_threads(STREAMING, stream_request, lambda i: (stack.url, body(i), streaming[i], first[i]))
    assert all(e.wait(60) for e in first), "the streaming requests never started"

    # The worker stops answering; the scheduler still believes it alive and hands it what it has room for.
    os.kill(old_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    silent = [Outcome() for _ in range(SILENT + QUEUED)]
    threads += start_threads(SILENT + QUEUED, plain_request,
                             lambda i: (stack.url, body(100 + i, max_tokens=6, model="demo-000" if i % 2 else "model"),
                                        silent[i]))
    assert wait_for(lambda: metric(stack.metrics(), "loraplex_queue_depth") == QUEUED, 5), \
        "the scheduler did not assign the silent requests to the stopped worker"
    if sig == signal.SIGKILL:
        os.kill(old_pid, signal.SIGKILL)
        failed_at = time.monotonic()
    else:
        failed_at = stopped_at  # the hang began here; the heartbeat must notice it

    # Streaming requests: exactly one terminal answer each, an error event, within the bound.
    join_all(threads[:STREAMING], bound_s + 5)
    for out in streaming:
        assert out.status == 200 and out.done and out.error is None, out
        assert out.terminals == ["error"], out.terminals
        assert out.ended - failed_at < bound_s, f"ended {out.ended - failed_at:.2f}s after the fault"
    # Silent and queued requests: requeued, then completed by the restarted worker.
    join_all(threads[STREAMING:], 90)
    for out in silent:
        assert out.status == 200, (out.status, out.body, out.error)
        assert out.body["usage"]["completion_tokens"] == 6 and out.body["choices"][0]["finish_reason"] == "length"

    assert wait_for(lambda: (pid := stack.service_pids().get("worker-0")) and pid != old_pid and ready(stack), 90), \
        "the worker was not restarted"
    assert not alive(old_pid), "the failed worker process is still there"
    wait_for(lambda: watch.changes[-1][1], 5)  # the watcher samples every 50 ms: let it see the ready we just saw
    watch.stop.set()
    watch.thread.join(5)
    assert watch.saw_false_then_true(), watch.changes
    log = stack.log()
    if sig == signal.SIGSTOP:
        assert "child.hung" in log or "heartbeat timeout" in log, "the hang was not detected by heartbeat"

    with stack.client() as c:
        for model in ("model", "demo-000"):
            r = c.post("/v1/completions", json=body(7, max_tokens=5, stream=False, model=model))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    idle_without_leaks(stack)
