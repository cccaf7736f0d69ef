"""The benchmark suite: S-LoRA's evaluation (workloads, load client, metrics, rooflines, baselines, plots)."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a Python child (a stack, a client shard, a measurement)
    that must import the repository's packages whatever its working directory."""
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
