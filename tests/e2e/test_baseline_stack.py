"""Engine settings behind the real stack: `loraplex up --set worker.lora_mode=bmm` (a baseline engine) and
`--set worker.overlap_steps=false` (steps launched ahead turned off, a boolean given a value) reach the worker's command
line, and concurrent requests over adapters and the base model come back exactly as the unified engine
computes them one step at a time."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from bench.metrics import by_label, parse_samples
from services.gpu_worker.step_stats import HELD_BACK_REASONS, STEP_KINDS

from .conftest import Stack
from .test_serving import BASE, complete, reference_texts, run_all


def settled_steps(url: str, timeout_s: float = 20.0) -> tuple[dict[str, float], dict[str, float]]:
    """Steps launched ahead and steps held back (by reason), summed over workers, once the gateway's view of the
    workers has stopped moving. Worker status reports and the gateway's pings each arrive on their own beat, so a
    reading taken right after the last response may still be one from mid-run: two equal readings a full second
    apart (four heartbeats, two pings) mean the counts are the worker's final ones."""
    def read() -> tuple[dict[str, float], dict[str, float], float]:
        samples = parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)
        ahead = {kind: sum(by_label(samples, "loraplex_worker_steps_ahead_total", "worker", kind=kind).values())
                 for kind in STEP_KINDS}
        held = {reason: sum(by_label(samples, "loraplex_worker_steps_held_back_total", "worker",
                                     reason=reason).values()) for reason in HELD_BACK_REASONS}
        steps = sum(sum(by_label(samples, "loraplex_worker_steps_total", "worker", kind=kind).values())
                    for kind in STEP_KINDS)
        return ahead, held, steps

    deadline = time.monotonic() + timeout_s
    last = read()
    while True:
        time.sleep(1.0)
        now = read()
        if (now[2] > 0 and now == last) or time.monotonic() > deadline:
            return now[0], now[1]
        last = now


def worker_command_line(stack: Stack) -> list[str]:
    pid = stack.service_pids()["worker-0"]
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


@pytest.mark.parametrize("setting, flag, value", [("lora_mode", "--lora-mode", "bmm"),
                                                  ("overlap_steps", "--overlap-steps", "false")])
def test_a_stack_with_an_engine_setting_serves_what_the_unified_engine_computes(tmp_path, setting, flag, value):
    stack = Stack(tmp_path / "data", "--demo-adapters", "2", "--set", f"worker.{setting}={value}",
                  "--set", "worker.max_running_requests=8")
    try:
        stack.start()
        argv = worker_command_line(stack)
        assert argv[argv.index(flag) + 1] == value
        data_dir = stack.data_dir
        adapters = {p.name: p for p in sorted((data_dir / "demo-adapters").glob("demo-*"))[:2]}
        models = sorted(adapters) + [BASE]
        # Nine requests of different lengths: several finish on one step while others are admitted.
        requests = [{"id": f"r{i}", "model": models[i % 3], "max_tokens": 4 + i % 5,
                     "prompt": [1] + [(11 * i + 7 * j) % 400 + 5 for j in range(2 + 4 * i)]} for i in range(9)]
        expected = reference_texts(data_dir / "model", adapters, requests)  # the unified engine, in process
        served = asyncio.run(run_all(stack.url, requests, complete))
        for r in requests:
            text, count = expected[r["id"]]
            assert served[r["id"]] == (text, count, "length"), r
        # Same prompt on both adapters and the base model: three different answers, so adapters were applied.
        same = [{**requests[0], "id": m, "model": m} for m in models]
        texts = asyncio.run(run_all(stack.url, same, complete))
        assert len({texts[m][0] for m in models}) == 3
        # The worker's counters, through the gateway's /metrics: with overlap_steps (the default, which the bmm
        # engine keeps), steps (admission steps among them) went ahead of the last step's tokens; turned off,
        # none did.
        ahead, held_back = settled_steps(stack.url)
        if setting == "overlap_steps":
            assert ahead and not any(ahead.values()), (ahead, held_back)
        else:
            assert ahead["decode"] > 0 and ahead["prefill"] > 0, (ahead, held_back)
    finally:
        stack.stop()
        stack.kill_everything()
