"""More adapters than either cache holds: a host arena of ~10 tiny adapters and a GPU pool that keeps 4, with
24 adapters in use at once. Adapters are read back from disk and copied into the pool again and again while
requests that already have theirs keep running; every request still returns exactly what the in-process
engine computes, and the worker is never taken for hung or restarted."""
from __future__ import annotations

import asyncio

import pytest

from shared.probes import metric
from tests.e2e.conftest import Stack, upload
from tests.e2e.test_serving import BASE, complete, reference_texts, run_all

ADAPTERS = 24


@pytest.fixture(scope="module")
def churn(tmp_path_factory):
    root = tmp_path_factory.mktemp("churn")
    stack = Stack(root / "data", "--arena-bytes", str(1024 * 1024), "--set", "worker.max_resident_adapters=4",
                  "--set", "worker.max_running_requests=8", "--set", "scheduler.first_token_slo_s=0").start()
    try:
        yield stack
    finally:
        stack.stop()
        stack.kill_everything()


def test_requests_over_more_adapters_than_the_caches_hold_match_the_engine(churn):
    from shared.make_adapters import make_adapters

    model_dir = churn.data_dir / "model"
    folders = make_adapters(churn.data_dir.parent / "adapters", model_dir, ADAPTERS, ranks=[8, 4, 16], seed=21,
                            prefix="churn")
    with churn.client() as c:
        for folder in folders:
            r = upload(c, folder, folder.name)
            assert r.status_code in (200, 201), r.text
    worker_pid = churn.service_pids()["worker-0"]
    names = [f.name for f in folders]
    # Each adapter three times, interleaved so consecutive requests name different adapters, and the base.
    requests = [{"id": f"c{i}", "model": (names + [BASE])[(7 * i) % (ADAPTERS + 1)],
                 "prompt": [1] + [(11 * i + 5 * j) % 400 + 5 for j in range(4 + i % 9)], "max_tokens": 4 + i % 5}
                for i in range(3 * (ADAPTERS + 1))]
    got = asyncio.run(run_all(churn.url, requests, complete))
    expected = reference_texts(model_dir, {f.name: f for f in folders}, requests)
    for r in requests:
        assert got[r["id"]] == (*expected[r["id"]], "length"), r

    text = churn.metrics()
    loads = metric(text, "loraplex_adapter_loads_total", worker="worker-0")
    assert loads is not None and loads > ADAPTERS  # evicted from the pool and loaded again
    # The arena (~10 of the 24) evicted adapters and read them back from disk.
    evictions = metric(text, "loraplex_arena_evictions_total")
    reads = metric(text, "loraplex_adapter_blob_reads_total")
    assert evictions > 0 and reads > 0 and metric(text, "loraplex_arena_loads_total") > ADAPTERS
    assert churn.service_pids()["worker-0"] == worker_pid, "the worker was restarted"
    log = churn.log()
    assert "child.hung" not in log and "child.died" not in log
    assert "adapter_loaded" in log  # read back from disk into the arena (registration alone would not say it)
