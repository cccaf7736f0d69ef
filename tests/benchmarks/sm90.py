"""Children that compile real sm_90 code on a machine without a GPU (the compile report, --ptx-loads)."""
from __future__ import annotations

from bench import child_env


def compile_env() -> dict[str, str]:
    """A child's environment without the Triton interpreter the test session runs under."""
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    return env
