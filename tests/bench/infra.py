"""Helpers of the bench infrastructure tests: tiny-setting stacks on one intra-op thread per service."""
from __future__ import annotations

from pathlib import Path

from bench.settings import get_setting
from bench.stack import Stack, StackConfig

TINY = get_setting("tiny")
# The services gain nothing from more threads on the tiny model; on a small shared machine idle ones cost.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def tiny_stack(work_dir: Path, population=None, n: int = 0, system: str = "loraplex", **kw) -> Stack:
    config = StackConfig(TINY, system, work_dir, population, n_adapters=n, device="cpu", progress=False,
                         env=dict(ONE_THREAD), ready_timeout_s=120, **kw)
    return Stack(config)
