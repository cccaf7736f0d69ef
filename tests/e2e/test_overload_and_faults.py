"""Overload and faults on the running stack: a full queue answers 429 with Retry-After; a client that
disconnects mid-stream has its request aborted and its slots returned (seen in /metrics); a worker killed
with SIGKILL ends its requests cleanly, is restarted by the launcher, and new requests succeed."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx

from shared.probes import metric, metric_samples, metric_sum
from tests.e2e.conftest import MAX_QUEUE, MAX_RUNNING

# The tiny model's whole context less the prompt: requests that must still be running when a test acts on
# them (a fast idle CPU once decoded 400 tokens before the test's reads of /metrics saw them running).
LONG = 2048 - 4


def long_body(i: int, max_tokens: int = LONG, stream: bool = True) -> dict:
    return {"model": "model", "prompt": [1, 9 + i % 50, 77, 78], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def wait_idle(stack, timeout_s: float = 60.0) -> str:
    """Metrics once nothing runs or waits and no KV slot is held (every slot free or holding an adapter)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = stack.metrics()
        kv = metric(text, "loraplex_pool_slots", worker="worker-0", kind="kv")
        running = metric(text, "loraplex_running_requests", worker="worker-0")
        queued = metric(text, "loraplex_queue_depth")
        if kv == 0 and running == 0 and queued == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"stack not idle after {timeout_s}s: kv={kv} running={running} queued={queued}")
        time.sleep(0.2)


def step_tokens(text: str) -> float:
    """Tokens worker-0's engine steps have computed, all kinds of step together."""
    return metric_sum(metric_samples(text), "loraplex_worker_step_tokens_total", worker="worker-0")


def test_full_queue_is_429_with_retry_after(stack):
    n = MAX_RUNNING + MAX_QUEUE + 14
    statuses: dict[int, httpx.Response] = {}

    async def one(client, i, release: asyncio.Event):
        async with client.stream("POST", "/v1/completions", json=long_body(i)) as r:
            if r.status_code != 200:
                await r.aread()
                statuses[i] = r
                return
            statuses[i] = r
            await release.wait()  # hold the slot until the test has seen the rejections

    async def main():
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=stack.url, timeout=120, limits=httpx.Limits(max_connections=n + 5)) as c:
            tasks = [asyncio.create_task(one(c, i, release)) for i in range(n)]
            deadline = time.monotonic() + 60
            while sum(r.status_code == 429 for r in statuses.values()) < n - MAX_RUNNING - MAX_QUEUE:
                assert time.monotonic() < deadline, {i: r.status_code for i, r in statuses.items()}
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()  # every client goes away: running and queued requests are aborted
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    rejected = [r for r in statuses.values() if r.status_code == 429]
    assert len(rejected) >= n - MAX_RUNNING - MAX_QUEUE
    assert {r.status_code for r in statuses.values()} <= {200, 429}
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert json.loads(r.content)["error"]["message"]
    text = wait_idle(stack)
    assert (metric(text, "loraplex_rejections_total", reason="queue_full") or 0) >= len(rejected)


def test_client_disconnect_mid_stream_aborts_and_frees_slots(stack):
    base = wait_idle(stack)
    total = metric(base, "loraplex_pool_slots", worker="worker-0", kind="total")
    aborts_before = metric(base, "loraplex_aborts_total", reason="client_disconnect") or 0
    computed_before = step_tokens(base)
    with stack.client() as c:
        with c.stream("POST", "/v1/completions", json=long_body(1)) as r:
            assert r.status_code == 200
            holding = False
            deadline = time.monotonic() + 30
            for line in r.iter_lines():
                # Metrics follow the workers' status with a short lag: read on until they show the KV held.
                if line.startswith("data: ") and metric(stack.metrics(), "loraplex_pool_slots", worker="worker-0", kind="kv"):
                    holding = True
                    break
                if time.monotonic() > deadline:
                    break
            assert holding, "the running request's KV slots never showed in /metrics"
        # Leaving the block closes the connection mid-stream.
    after = wait_idle(stack, 30)
    assert metric(after, "loraplex_aborts_total", reason="client_disconnect") == aborts_before + 1
    free = metric(after, "loraplex_pool_slots", worker="worker-0", kind="free")
    adapter = metric(after, "loraplex_pool_slots", worker="worker-0", kind="adapter")
    assert free + adapter == total
    # The request stopped on the worker: it computed its prompt and some tokens, far fewer than max_tokens.
    computed = step_tokens(after) - computed_before
    assert 4 < computed < LONG / 2, computed


def test_sigkill_worker_ends_its_requests_cleanly_and_it_comes_back(stack):
    wait_idle(stack)
    old_pid = stack.service_pids()["worker-0"]
    outcomes: dict[int, dict] = {}
    started = threading.Barrier(MAX_RUNNING + 1)

    def streamed(i: int):
        """A request that is running (tokens flowing) when the worker dies."""
        out = {"finish": None, "error": None, "done": False, "tokens": 0}
        outcomes[i] = out
        with stack.client(timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long_body(i)) as r:
                out["status"] = r.status_code
                first = True
                for line in r.iter_lines():
                    if first and line.startswith("data: "):
                        first = False
                        started.wait(60)
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            out["error"] = event["error"]["message"]
                        else:
                            out["tokens"] += 1
                            out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
                out["ended"] = time.monotonic()

    threads = [threading.Thread(target=streamed, args=(i,)) for i in range(MAX_RUNNING)]
    for t in threads:
        t.start()
    started.wait(120)  # every request has streamed a token
    # Queued behind the full worker: these have streamed nothing when it dies.
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        late: list = []
        late_threads = [threading.Thread(target=lambda i=i: late.append(
            c.post("/v1/completions", json=long_body(100 + i, max_tokens=4, stream=False)))) for i in range(3)]
        for t in late_threads:
            t.start()
        deadline = time.monotonic() + 30
        while metric(stack.metrics(), "loraplex_queue_depth") != len(late_threads):
            assert time.monotonic() < deadline, "the late requests never showed queued"
            time.sleep(0.05)
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(30)
        for t in late_threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads + late_threads), "a request hung after its worker died"
    for i, out in outcomes.items():
        assert out["status"] == 200 and out["done"], out
        # One terminal answer each: an error event (it had streamed, so it cannot be replayed silently).
        assert out["error"] and out["finish"] is None, out
        assert out["ended"] - killed_at < 10, out
    # Those that had streamed nothing were run by the restarted worker (or refused cleanly, never hung).
    assert len(late) == 3
    for r in late:
        assert r.status_code in (200, 503), r.text
    assert any(r.status_code == 200 for r in late), [r.text for r in late]

    deadline = time.monotonic() + 120
    while True:
        new_pid = stack.service_pids().get("worker-0")
        with stack.client() as c:
            ready = c.get("/ready").status_code == 200
        if new_pid and new_pid != old_pid and ready:
            break
        assert time.monotonic() < deadline, "worker was not restarted"
        time.sleep(0.2)
    with stack.client() as c:
        r = c.post("/v1/completions", json=long_body(7, max_tokens=5, stream=False))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    text = wait_idle(stack)
    assert metric(text, "loraplex_pool_slots", worker="worker-0", kind="kv") == 0
    assert "worker-0" in stack.log() and "child.died" in stack.log()
