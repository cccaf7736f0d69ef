"""The stack's lifecycle: SIGTERM drains (in-flight requests finish, new ones get 503) and every child exits;
a new stack on the same data dir has every registration and serves the same tokens; a launcher killed with
SIGKILL leaves no process and no shared-memory arena behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from shared.make_adapters import make_adapters
from shared.probes import descendants, metric
from tests.e2e.conftest import Stack, upload, wait_gone

PROMPT = [1, 30, 31, 32, 33]


def outputs(stack, models: list[str]) -> dict[str, str]:
    with stack.client() as c:
        out = {}
        for m in models:
            r = c.post("/v1/completions", json={"model": m, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            out[m] = r.json()["choices"][0]["text"]
        return out


def registrations(stack) -> dict[str, tuple]:
    with stack.client() as c:
        return {a["name"]: (a["id"], a["sha256"], a["rank"], tuple(a["target_modules"]))
                for a in c.get("/v1/adapters").json()["data"]}


def refusal_during_drain(stack, timeout_s: float = 10.0):
    """What the gateway answers a new request with once /ready says it no longer accepts any (a request sent
    before that would wait on the held worker), or None when it never says so."""
    deadline = time.monotonic() + timeout_s
    with stack.client(timeout=10) as c:
        try:
            while c.get("/ready").json()["checks"]["accepting"]:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)
            return c.post("/v1/completions", json={"model": "model", "prompt": PROMPT, "max_tokens": 2})
        except httpx.TransportError as e:
            raise AssertionError(f"the gateway stopped serving during the drain: {e!r}") from e


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("restart") / "data"


def test_sigterm_drains_then_restart_keeps_registrations_and_tokens(data_dir, tmp_path):
    first = Stack(data_dir, "--drain-timeout-s", "60").start()
    try:
        extra = make_adapters(tmp_path, data_dir / "model", 2, ranks=[6, 20], seed=1234, prefix="kept")
        with first.client() as c:
            for folder in extra:
                assert upload(c, folder, folder.name).status_code == 201
        before = registrations(first)
        assert {"demo-000", "demo-003", "kept-000", "kept-001"} <= set(before)
        models = ["model", "demo-000", "demo-003", "kept-000", "kept-001"]
        tokens = outputs(first, models)

        # A request in flight when SIGTERM arrives finishes; one that arrives during the drain gets 503.
        children = descendants(first.proc.pid)
        assert len(children) >= 5
        events, streaming = [], threading.Event()

        def stream():
            with first.client(timeout=60) as c:
                body = {"model": "kept-001", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                            streaming.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streaming.wait(60)
        # The worker (which the drain leaves running) is held still until a refusal is seen, so the stream is
        # still in flight then however fast the CPU (40 tokens once ended before the drain began).
        worker = first.service_pids()["worker-0"]
        os.kill(worker, signal.SIGSTOP)
        try:
            first.proc.send_signal(signal.SIGTERM)
            refused = refusal_during_drain(first)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert refused is not None, "the gateway never stopped accepting"
        assert refused.status_code == 503 and refused.json()["error"]["message"], refused.text
        t.join(90)
        assert not [e for e in events if "error" in e], events[-1]
        assert [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]] == ["length"]
        assert first.proc.wait(60) == 0
        assert wait_gone(children, 10) == [], "children outlived the launcher's SIGTERM"
    finally:
        first.stop()
        first.kill_everything()

    second = Stack(data_dir).start()
    try:
        assert registrations(second) == before
        assert outputs(second, models) == tokens
    finally:
        second.stop()
        second.kill_everything()


def test_two_workers_serve_and_a_sigkilled_launcher_leaves_no_orphans(tmp_path):
    stack = Stack(tmp_path / "data", "--demo-adapters", "1", "--workers", "2").start()
    try:
        pids = stack.service_pids()
        assert {"redis", "adapter_store", "scheduler", "worker-0", "worker-1", "gateway"} <= set(pids)
        text = stack.metrics()
        assert metric(text, "loraplex_workers_ready") == 2
        assert metric(text, "loraplex_pool_slots", worker="worker-1", kind="total") == 4096
        # Concurrent requests spread over both workers: each model gives the same text wherever it runs.
        from concurrent.futures import ThreadPoolExecutor

        models = ["model", "demo-000"] * 4
        with ThreadPoolExecutor(len(models)) as pool:
            texts = list(pool.map(lambda m: outputs(stack, [m])[m], models))
        assert len(set(texts[0::2])) == 1 and len(set(texts[1::2])) == 1 and texts[0] != texts[1]
        everything = descendants(stack.proc.pid)
        arena = f"/dev/shm/loraplex-arena-{pids['adapter_store']}"
        assert os.path.exists(arena)
        stack.proc.send_signal(signal.SIGKILL)
        stack.proc.wait(10)
        assert wait_gone(everything, 30) == [], "processes outlived a SIGKILLed launcher"
        assert not os.path.exists(arena), "the store's arena segment was left in /dev/shm"
    finally:
        stack.stop()
        stack.kill_everything()


def test_external_redis_url_is_used_instead_of_an_embedded_one(tmp_path):
    from tests.adapter_store.conftest import RedisServer

    redis_server = RedisServer(tmp_path / "external-redis")
    redis_server.start()
    stack = Stack(tmp_path / "data", "--demo-adapters", "1", "--redis-url", redis_server.url)
    try:
        stack.start()
        assert "redis" not in stack.service_pids()
        assert registrations(stack).keys() == {"demo-000"}
        keys = redis_server.client().keys("*")
        assert keys, "the registry was not written to the given Redis"
    finally:
        stack.stop()
        stack.kill_everything()
        redis_server.stop()
