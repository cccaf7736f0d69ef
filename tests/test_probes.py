"""Probes of a running stack: ports for the launcher and the tests, a process's CPU time."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from shared.probes import cpu_seconds, free_ports


def test_ports_are_distinct_bindable_and_skip_excluded_ones():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    busy = taken.getsockname()[1]
    try:
        for _ in range(100):
            ports = free_ports(6, exclude={busy})
            assert len(set(ports)) == 6 and busy not in ports
        held = []
        for port in free_ports(4):  # all of them can be bound at once
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            held.append(s)
        for s in held:
            s.close()
    finally:
        taken.close()


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
