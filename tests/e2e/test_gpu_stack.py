"""The whole stack on a CUDA GPU (skipped without one): the worker maps the store's arena and registers it
with CUDA as pinned memory, adapter rows reach the GPU pool from it, and concurrent greedy requests over the
demo adapters and the base model return what the in-process engine computes on the same GPU."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.e2e.conftest import Stack
from tests.e2e.test_serving import cases, complete, complete_streaming, reference_texts, run_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLOTS = 8192


def test_stack_on_cuda_matches_the_in_process_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-stack")
    stack = Stack(root / "data", "--dtype", "float32", "--num-slots", str(SLOTS), device="cuda").start()
    try:
        adapters = {p.name: p for p in sorted((stack.data_dir / "demo-adapters").glob("demo-*"))}
        requests = cases(sorted(adapters), 20)
        plain = asyncio.run(run_all(stack.url, requests, complete))
        streamed = asyncio.run(run_all(stack.url, requests, complete_streaming))
        log = stack.log()
    finally:
        stack.stop()
        stack.kill_everything()
    assert "arena.pinned" in log and "arena.pin_failed" not in log
    expected = reference_texts(stack.data_dir / "model", adapters, requests,
                               engine_config=dict(device="cuda", dtype="float32", num_slots=SLOTS))
    for r in requests:
        assert plain[r["id"]] == (*expected[r["id"]], "length"), r
        assert streamed[r["id"]] == plain[r["id"]], r


def test_default_bfloat16_stack_serves_every_adapter(tmp_path_factory):
    """The default CUDA dtype: the arena holds bfloat16 rows, copied as they are."""
    stack = Stack(tmp_path_factory.mktemp("gpu-bf16") / "data", device="cuda").start()
    try:
        adapters = sorted(p.name for p in (stack.data_dir / "demo-adapters").glob("demo-*"))
        requests = cases(adapters, 10)
        plain = asyncio.run(run_all(stack.url, requests, complete))
        streamed = asyncio.run(run_all(stack.url, requests, complete_streaming))
    finally:
        stack.stop()
        stack.kill_everything()
    for r in requests:
        assert plain[r["id"]][1:] == (r["max_tokens"], "length")
        assert streamed[r["id"]] == plain[r["id"]], r
