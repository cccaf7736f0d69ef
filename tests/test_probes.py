"""Probes of a running stack: a process's CPU time."""
from __future__ import annotations

import subprocess
import sys
import time

from shared.probes import cpu_seconds


def test_cpu_seconds_counts_a_busy_process_and_none_once_it_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\nimport sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while (cpu_seconds(child.pid) or 0) < 0.4:
            assert time.monotonic() < deadline, cpu_seconds(child.pid)
            time.sleep(0.05)
    finally:
        child.communicate(b"", timeout=20)
    assert cpu_seconds(child.pid) is None
