"""Steps launched ahead behind the real stack: `loraplex up --set worker.overlap_steps=true` reaches the worker
(a boolean setting given a value), and concurrent greedy requests over adapters and the base model, several
finishing on the same steps, come back exactly as the engine computes them one step at a time."""
from __future__ import annotations

import asyncio

from .conftest import Stack
from .test_baseline_stack import worker_command_line
from .test_serving import BASE, complete, reference_texts, run_all


def test_a_stack_with_steps_launched_ahead_serves_what_the_engine_computes(tmp_path):
    stack = Stack(tmp_path / "data", "--demo-adapters", "2", "--set", "worker.overlap_steps=true",
                  "--set", "worker.max_running_requests=8")
    try:
        stack.start()
        argv = worker_command_line(stack)
        assert argv[argv.index("--overlap-steps") + 1] == "true"
        data_dir = stack.data_dir
        adapters = {p.name: p for p in sorted((data_dir / "demo-adapters").glob("demo-*"))[:2]}
        models = sorted(adapters) + [BASE]
        requests = [{"id": f"r{i}", "model": models[i % 3], "max_tokens": 4 + i % 5,
                     "prompt": [1] + [(13 * i + 5 * j) % 400 + 5 for j in range(3 + 4 * i)]} for i in range(9)]
        expected = reference_texts(data_dir / "model", adapters, requests)  # overlap off, in process
        served = asyncio.run(run_all(stack.url, requests, complete))
        for r in requests:
            text, count = expected[r["id"]]
            assert served[r["id"]] == (text, count, "length"), r
    finally:
        stack.stop()
        stack.kill_everything()
