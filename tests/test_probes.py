"""Port probing for the launcher and the tests."""
from __future__ import annotations

import socket

from shared.probes import free_ports


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
