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

from tests.e2e.conftest import metric
from tests.reliability.conftest import (
    GENERAL_MAX_RUNNING, Outcome, body, idle_without_leaks, join_all, start_threads, stream_request,
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

    # Reference texts (and a stop string that only matches at their very end) and the typical duration.
    references: dict[tuple[str, int], str] = {}
    durations = []
    with stack.client() as c:
        for model in MODELS:
            for p in range(3):
                started = time.monotonic()
                r = c.post("/v1/completions", json=body(p, max_tokens=8, stream=False, model=model))
                durations.append(time.monotonic() - started)
                references[(model, p)] = r.json()["choices"][0]["text"]
    typical = sorted(durations)[len(durations) // 2] * 2  # under concurrency each takes longer

    finished: list[list[str]] = []
    cancelled = 0

    async def one(client, i, limit):
        nonlocal cancelled
        model, p = MODELS[i % 3], i % 3
        payload = body(p, max_tokens=8, stream=bool(i % 2), model=model)
        text = references[(model, p)]
        if i % 5 == 0 and len(text.strip()) >= 2:
            payload["stop"] = [text[-2:]]  # found when the last token arrives: abort and finish cross
        async with limit:
            try:
                finished.append(await asyncio.wait_for(read_to_end(client, payload), rng.uniform(0.3, 1.7) * typical))
            except asyncio.TimeoutError:
                cancelled += 1

    async def main():
        limit = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60,
                                     limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:
            await asyncio.gather(*(one(client, i, limit) for i in range(REQUESTS)))

    asyncio.run(main())
    assert cancelled > REQUESTS // 10 and len(finished) > REQUESTS // 10, (cancelled, len(finished))
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
    assert len(finished) + len(references) <= counted <= REQUESTS + len(references)

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
