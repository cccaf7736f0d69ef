"""Cancellation racing completion: many requests, each cancelled by its client at a random moment around
the time it completes (connections closed mid-body, mid-stream, right at the end), plus stop strings that
hit on the last token (the gateway's abort crosses the worker's finish). Every request that is read to its
end has exactly one terminal answer; afterwards nothing has leaked (slots, pins, the gateway's count, the
scheduler's capacity) and no process crashed."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx

from shared.probes import metric
from tests.reliability.conftest import (
    GENERAL_MAX_RUNNING,
    Outcome,
    body,
    idle_without_leaks,
    join_all,
    start_threads,
    stream_request,
)

REQUESTS = 160
CONCURRENCY = 12
MODELS = ["model", "demo-000", "demo-001"]


async def read_to_end(client: httpx.AsyncClient, payload: dict) -> list[str]:
    """The terminal answers of one request: finish reasons and error events."""
    if not payload["stream"]:
        r = await client.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        return [c["finish_reason"] for c in r.json()["choices"]]
    terminals, done = [], 0
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                assert not done, "an event after [DONE]"
                event = json.loads(line[6:])
                terminals += ["error"] if "error" in event else [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
    assert done == 1
    return terminals


def test_cancel_racing_completion_gives_one_terminal_answer_and_leaks_nothing(general_stack):
    stack = general_stack
    idle_without_leaks(stack)
    pids = stack.service_pids()
    log_start = len(stack.log())
    rng = random.Random(5)
    before = stack.metrics()

    # Reference texts, for stop strings that only match at their very end.
    references: dict[tuple[str, int], str] = {}
    with stack.client() as c:
        for model in MODELS:
            for p in range(3):
                r = c.post("/v1/completions", json=body(p, max_tokens=8, stream=False, model=model))
                references[(model, p)] = r.json()["choices"][0]["text"]

    finished: list[list[str]] = []
    cancelled = 0
    typical = 0.0

    recent: list[float] = []  # durations of the latest requests read to their end

    async def one(client, i, limit):
        nonlocal cancelled
        model, p = MODELS[i % 3], i % 3
        payload = body(p, max_tokens=8, stream=bool(i % 4 < 2), model=model)
        text = references[(model, p)]
        if i % 5 == 0 and len(text.strip()) >= 2:
            payload["stop"] = [text[-2:]]  # found when the last token arrives: abort and finish cross
        async with limit:
            started = time.monotonic()
            if i % 2 == 0:  # read to the end: keeps the picture of how long a request takes right now
                finished.append(await read_to_end(client, payload))
                recent.append(time.monotonic() - started)
                return
            window = sorted(recent[-20:]) or [typical]
            deadline = rng.uniform(0.3, 1.7) * window[len(window) // 2]
            try:
                finished.append(await asyncio.wait_for(read_to_end(client, payload), deadline))
            except TimeoutError:
                cancelled += 1

    async def timed(client, i, limit):
        async with limit:
            started = time.monotonic()
            await read_to_end(client, body(i % 3, max_tokens=8, stream=bool(i % 2), model=MODELS[i % 3]))
            return time.monotonic() - started

    async def main():
        nonlocal typical
        limit = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60,
                                     limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:
            # How long a request takes at this concurrency, on this machine, now: cancels land around it.
            durations = sorted(await asyncio.gather(*(timed(client, i, limit) for i in range(2 * CONCURRENCY))))
            typical = durations[len(durations) // 2]
            await asyncio.gather(*(one(client, i, limit) for i in range(REQUESTS)))

    asyncio.run(main())
    print("COUNTS", cancelled, len(finished), typical)
    # Half the requests were cancelled around their expected end: some before, some just after it.
    assert REQUESTS // 10 < cancelled < REQUESTS // 2 - REQUESTS // 10, (cancelled, len(finished))
    for terminals in finished:
        assert len(terminals) == 1 and terminals[0] in ("length", "stop"), terminals

    after = idle_without_leaks(stack)
    assert stack.service_pids() == pids, "a process died during the cancel storm"
    log = stack.log()[log_start:]
    for sign in ("Traceback", "handler failed", "child.died", "worker.engine_failed"):
        assert sign not in log, f"{sign!r} in the log:\n{log[log.index(sign) - 2000:log.index(sign) + 2000]}"
    # Each request was counted once, as answered (200) or abandoned (499).
    counted = sum((metric(after, "loraplex_requests_total", endpoint="completions", status=s) or 0)
                  - (metric(before, "loraplex_requests_total", endpoint="completions", status=s) or 0)
                  for s in ("200", "499"))
    assert len(finished) + len(references) + 2 * CONCURRENCY <= counted <= REQUESTS + len(references) + 2 * CONCURRENCY

    # The scheduler's capacity bookkeeping survived: a full batch runs at once.
    cancel = threading.Event()
    outs = [Outcome() for _ in range(GENERAL_MAX_RUNNING)]
    first = [threading.Event() for _ in outs]
    threads = start_threads(len(outs), stream_request, lambda i: (stack.url, body(i), outs[i], first[i], 60.0, cancel))
    try:
        assert all(e.wait(30) for e in first), "a full batch no longer runs at once: capacity leaked"
    finally:
        cancel.set()
        join_all(threads, 30)
    idle_without_leaks(stack)
