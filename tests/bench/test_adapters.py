"""Adapter populations: distinct weight sets up to a byte budget, further names linked to them, written
once (resumable), and registered in bulk through the public API by server path (resumable too)."""
import json
import os
import time

import pytest
import torch
from safetensors import safe_open

import bench.adapters as bench_adapters
from bench.adapters import (
    CONFIG_FILE, WEIGHTS_FILE, distinct_cap, generate_adapters, register, registered_names, set_rank,
)
from tests.bench.infra import TINY, tiny_stack


def inode(path):
    return os.stat(path).st_ino


def test_distinct_sets_fill_the_byte_budget_exactly():
    budget = 5 * TINY.adapter_bytes(8)
    cap = distinct_cap(TINY, budget, seed=3)
    sizes = [TINY.adapter_bytes(set_rank(TINY, 3, k)) for k in range(cap + 1)]
    assert sum(sizes[:cap]) <= budget < sum(sizes)
    assert distinct_cap(TINY, 1, seed=3) == 1  # even a budget below one adapter writes one


def test_population_writes_distinct_sets_then_links(tmp_path):
    budget = 4 * TINY.adapter_bytes(2)  # room for 4 sets at the smallest rank, fewer at larger ones
    pop = generate_adapters(TINY, tmp_path / "pop", 12, seed=1, byte_budget=budget, progress=False)
    d = pop.distinct
    assert d == distinct_cap(TINY, budget, seed=1) and 1 <= d < 12
    assert (pop.written, pop.linked) == (d, 12 - d)
    assert pop.distinct_bytes <= budget
    for i, name in enumerate(pop.names):
        folder = tmp_path / "pop" / name
        config = json.loads((folder / CONFIG_FILE).read_text())
        assert config["r"] == pop.ranks[i] in TINY.ranks
        assert config["target_modules"] == list(TINY.targets)
        same = tmp_path / "pop" / pop.names[i % d] / WEIGHTS_FILE
        assert inode(folder / WEIGHTS_FILE) == inode(same)  # name i is set i % distinct, linked
        if i >= d:
            assert os.stat(folder / WEIGHTS_FILE).st_nlink >= 2
    with safe_open(str(tmp_path / "pop" / pop.names[0] / WEIGHTS_FILE), "pt") as f:
        key = next(iter(f.keys()))
        assert f.get_tensor(key).dtype == torch.bfloat16
    # The weights file holds the adapter's parameters in bf16, plus its small header.
    size = os.path.getsize(tmp_path / "pop" / pop.names[0] / WEIGHTS_FILE)
    assert TINY.adapter_bytes(pop.ranks[0]) < size < TINY.adapter_bytes(pop.ranks[0]) + 64 * 1024
    # distinct sets differ from each other
    blobs = {(tmp_path / "pop" / n / WEIGHTS_FILE).read_bytes() for n in pop.names}
    assert len(blobs) == d


def test_sets_written_side_by_side_hold_the_bytes_of_sets_written_one_by_one(tmp_path, monkeypatch):
    budget = 6 * TINY.adapter_bytes(2)
    side_by_side = generate_adapters(TINY, tmp_path / "threads", 10, seed=4, byte_budget=budget, progress=False)
    monkeypatch.setattr(bench_adapters, "WRITER_THREADS", 1)
    one_by_one = generate_adapters(TINY, tmp_path / "one", 10, seed=4, byte_budget=budget, progress=False)
    assert side_by_side.distinct == one_by_one.distinct > 1
    for name in side_by_side.names:
        assert ((tmp_path / "threads" / name / WEIGHTS_FILE).read_bytes()
                == (tmp_path / "one" / name / WEIGHTS_FILE).read_bytes()), name


def test_population_resumes_extends_and_refuses_another_seed(tmp_path):
    root = tmp_path / "pop"
    budget = 3 * TINY.adapter_bytes(2)
    stopped = generate_adapters(TINY, root, 6, seed=2, byte_budget=budget, progress=False, deadline=time.monotonic() - 1)
    assert not stopped.complete and stopped.written == 0
    first = generate_adapters(TINY, root, 6, seed=2, byte_budget=budget, progress=False)
    assert first.complete
    before = {n: (root / n / WEIGHTS_FILE).stat().st_mtime_ns for n in first.names}
    again = generate_adapters(TINY, root, 6, seed=2, byte_budget=budget, progress=False)
    assert (again.written, again.linked) == (0, 0)
    # A larger n keeps every existing name's content and adds names linked to the same sets.
    more = generate_adapters(TINY, root, 9, seed=2, byte_budget=10**9, progress=False)
    assert more.distinct == first.distinct and (more.written, more.linked) == (0, 3)
    assert {n: (root / n / WEIGHTS_FILE).stat().st_mtime_ns for n in first.names} == before
    with pytest.raises(ValueError, match="seed 2"):
        generate_adapters(TINY, root, 6, seed=5, progress=False)


@pytest.fixture(scope="module")
def served_population(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-adapters")
    pop = generate_adapters(TINY, work / "adapters" / "tiny-s0", 12, byte_budget=3 * TINY.adapter_bytes(4),
                            progress=False)
    stack = tiny_stack(work, pop, n=0).start()  # registers nothing itself: the tests do
    try:
        yield stack, pop
    finally:
        stack.stop()


def test_bulk_registration_by_path_resumes_and_serves(served_population):
    import asyncio

    import httpx

    stack, pop = served_population
    # A registration that reached its deadline registers nothing more; the next one picks up from there.
    stopped = register(stack.url, pop.root, pop.names[:8], concurrency=4, progress=False, deadline=time.monotonic() - 1)
    assert stopped.stopped_at_deadline and not stopped.complete and stopped.created == 0
    first = register(stack.url, pop.root, pop.names[:8], concurrency=4, progress=False)
    assert first.complete and (first.created, first.already) == (8, 0) and first.rate > 0
    second = register(stack.url, pop.root, pop.names, concurrency=4, progress=False)
    assert second.complete and (second.created, second.already) == (4, 8)

    async def listed():
        async with httpx.AsyncClient(base_url=stack.url) as c:
            return await registered_names(c)
    assert asyncio.run(listed()) >= set(pop.names)
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        cards = {a["name"]: a for a in c.get("/v1/adapters").json()["data"]}
        # Names sharing a weight set are distinct adapters with the same content hash.
        shared = [n for i, n in enumerate(pop.names) if pop.set_of(i) == 0]
        assert len(shared) >= 2 and len({cards[n]["id"] for n in shared}) == len(shared)
        assert len({cards[n]["sha256"] for n in shared}) == 1
        assert all(cards[n]["rank"] == r for n, r in zip(pop.names, pop.ranks))
        r = c.post("/v1/completions", json={"model": pop.names[-1], "prompt": [5, 6, 7], "max_tokens": 3,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_registration_failures_are_reported_per_adapter(served_population, tmp_path):
    stack, pop = served_population
    result = register(stack.url, pop.root, ["no-such-adapter"], progress=False)
    assert not result.complete and "no-such-adapter" in result.failed
    assert "400" in result.failed["no-such-adapter"]
