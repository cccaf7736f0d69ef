"""A baseline engine behind the real stack: `loraplex up --set worker.lora_mode=bmm` reaches the worker's
command line, and concurrent requests over adapters and the base model come back exactly as the unified
engine computes them."""
from __future__ import annotations

import asyncio
from pathlib import Path

from .conftest import Stack
from .test_serving import BASE, complete, reference_texts, run_all


def worker_command_line(stack: Stack) -> list[str]:
    pid = stack.service_pids()["worker-0"]
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def test_bmm_stack_serves_what_the_unified_engine_computes(tmp_path):
    stack = Stack(tmp_path / "data", "--demo-adapters", "2", "--set", "worker.lora_mode=bmm",
                  "--set", "worker.max_running_requests=8")
    try:
        stack.start()
        argv = worker_command_line(stack)
        assert argv[argv.index("--lora-mode") + 1] == "bmm"
        data_dir = stack.data_dir
        adapters = {p.name: p for p in sorted((data_dir / "demo-adapters").glob("demo-*"))[:2]}
        models = sorted(adapters) + [BASE]
        requests = [{"id": f"r{i}", "model": models[i % 3], "max_tokens": 5 + i % 4,
                     "prompt": [1] + [(11 * i + 7 * j) % 400 + 5 for j in range(2 + 5 * i)]} for i in range(6)]
        expected = reference_texts(data_dir / "model", adapters, requests)  # the unified engine, in process
        served = asyncio.run(run_all(stack.url, requests, complete))
        for r in requests:
            text, count = expected[r["id"]]
            assert served[r["id"]] == (text, count, "length"), r
        # Same prompt on both adapters and the base model: three different answers, so adapters were applied.
        same = [{**requests[0], "id": m, "model": m} for m in models]
        texts = asyncio.run(run_all(stack.url, same, complete))
        assert len({texts[m][0] for m in models}) == 3
    finally:
        stack.stop()
        stack.kill_everything()
