"""Auth on a whole launched stack (the gateway-level tests in tests/gateway use fake peers): one tenant over its
queue bound gets 429 while another tenant's requests are admitted and served; no key, right or wrong, is
written to any service's log or to anything in the data dir (Redis's AOF included); a tenant's key cannot
manage adapters and a tenant cannot use or even see another tenant's adapter."""
from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from shared.probes import metric
from tests.reliability.conftest import (
    Outcome,
    Stack,
    body,
    idle_without_leaks,
    join_all,
    plain_request,
    running,
    start_threads,
    stream_request,
    wait_for,
)

ADMIN = "adm-7f3e9c1d5b2a4e6f8091"
ACME = "acme-2b8d4f6a0c1e3579bd"
GLOBEX = "glx-93c5e7a1f0b2d4c6e8a"
WRONG = "guess-0a1b2c3d4e5f60718"
PER_TENANT = 2
MAX_RUNNING = 2


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-stack")
    keys = root / "keys.json"
    keys.write_text(json.dumps({"admin_keys": [ADMIN], "tenants": {"acme": [ACME], "globex": [GLOBEX]}}))
    with running(Stack(root / "data", "--demo-adapters", "1", "--api-keys-file", str(keys),
                       "--set", f"scheduler.max_queue_per_tenant={PER_TENANT}",
                       "--set", f"worker.max_running_requests={MAX_RUNNING}",
                       "--set", "scheduler.first_token_slo_s=0",
                       # The queue test stops the worker for a while: not long enough to be taken for hung.
                       "--heartbeat-timeout-s", "60")) as s:
        yield s


def test_a_tenant_over_its_queue_bound_is_refused_alone(secured):
    stack = secured
    # acme fills the worker with two long streams, then queues up to its bound.
    cancel = threading.Event()
    running = [Outcome() for _ in range(MAX_RUNNING)]
    first = [threading.Event() for _ in running]
    threads = start_threads(MAX_RUNNING, stream_request,
                            lambda i: (stack.url, body(i), running[i], first[i], 120.0, cancel, auth(ACME)))
    assert all(e.wait(60) for e in first)
    # The worker is stopped while the queue is examined, so its two streams cannot end (a fast CPU decodes
    # the model's whole context in ~3 s) and let a queued request in.
    worker = stack.service_pids()["worker-0"]
    os.kill(worker, signal.SIGSTOP)
    try:
        queued, others, waiting = examine_tenant_queues(stack)
    finally:
        os.kill(worker, signal.SIGCONT)
    cancel.set()
    join_all(threads + waiting, 60)
    for out in queued + others:
        assert out.status == 200 and out.body["usage"]["completion_tokens"] == 3, (out.status, out.body)
    assert metric(stack.metrics(), "loraplex_rejections_total", reason="tenant_queue_full") == 1
    idle_without_leaks(stack)


def examine_tenant_queues(stack) -> tuple[list, list, list]:
    """acme queues up to its bound and its next request is refused; globex's are then admitted beyond it.
    The queued requests' outcomes, acme's and globex's, and their threads (for the caller to join)."""
    queued = [Outcome() for _ in range(PER_TENANT)]
    threads = start_threads(PER_TENANT, plain_request,
                            lambda i: (stack.url, body(10 + i, max_tokens=3), queued[i], 120.0, auth(ACME)))
    assert wait_for(lambda: metric(stack.metrics(), "loraplex_queue_depth") == PER_TENANT, 10)

    over = Outcome()
    plain_request(stack.url, body(20, max_tokens=3), over, 30.0, auth(ACME))
    assert over.status == 429 and int(over.headers["retry-after"]) >= 1, (over.status, over.body)
    assert "tenant" in over.body["error"]["message"]
    # globex is not acme: its requests join the queue (beyond acme's bound) and are served.
    others = [Outcome() for _ in range(PER_TENANT)]
    threads += start_threads(PER_TENANT, plain_request,
                             lambda i: (stack.url, body(30 + i, max_tokens=3), others[i], 120.0, auth(GLOBEX)))
    assert wait_for(lambda: metric(stack.metrics(), "loraplex_queue_depth") == 2 * PER_TENANT, 10), \
        "globex's requests were not admitted"
    return queued, others, threads


def test_tenants_are_isolated_and_keys_are_never_written_anywhere(secured, tmp_path):
    stack = secured
    from shared.make_adapters import make_adapters

    folder = make_adapters(tmp_path, stack.data_dir / "model", 1, ranks=[4], seed=77, prefix="acme-private")[0]
    with stack.client(headers=auth(ADMIN)) as admin, stack.client(headers=auth(ACME)) as acme, \
            stack.client(headers=auth(GLOBEX)) as globex, stack.client() as anonymous, \
            stack.client(headers=auth(WRONG)) as wrong:
        files = {"adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
                 "adapter_model": ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())}
        assert acme.post("/v1/adapters", data={"name": "mine"}, files=files).status_code == 403
        r = admin.post("/v1/adapters", data={"name": "mine", "tenant": "acme"}, files=files)
        assert r.status_code == 201, r.text
        ask = {"model": "mine", "prompt": [1, 5, 6], "max_tokens": 2}
        assert acme.post("/v1/completions", json=ask).status_code == 200
        assert globex.post("/v1/completions", json=ask).status_code == 404  # not 403: existence stays hidden
        assert "mine" in {m["id"] for m in acme.get("/v1/models").json()["data"]}
        assert "mine" not in {m["id"] for m in globex.get("/v1/models").json()["data"]}
        assert anonymous.post("/v1/completions", json=ask).status_code == 401
        assert wrong.post("/v1/completions", json=ask).status_code == 401
        assert wrong.get("/v1/adapters").status_code == 401
        assert admin.delete("/v1/adapters/mine", params={"tenant": "acme"}).status_code == 204
    # Every service's log (the launcher's output holds them all) and every file the stack wrote.
    places = {"log": stack.log()}
    for path in stack.data_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 64 * 2**20:
            places[str(path)] = path.read_bytes().decode("latin-1")
    for key in (ADMIN, ACME, GLOBEX, WRONG):
        leaked = [where for where, text in places.items() if key in text]
        assert not leaked, f"a key was written to {leaked}"
    assert "tenant" in places["log"] or "acme" in places["log"]  # the logs name tenants, never keys
