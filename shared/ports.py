"""TCP ports for a stack's own endpoints, and what a service does when its port turns out to be taken.

A port is chosen by one process and bound by another a few seconds later (the launcher picks the scheduler's
and the store's endpoints, the services bind them). Ports the kernel hands out for `bind(0)` come from the
same ephemeral range as the local ports of outgoing connections, so any `connect()` in that window (a
Redis client, a ZeroMQ peer, an HTTP probe: a starting stack makes hundreds) can take the chosen port.
Choosing below that range leaves only one way to collide: another process choosing the same random port
at the same moment. For that one, a service exits with EXIT_ADDRESS_IN_USE and the launcher starts again
on fresh ports.
"""
from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

# A service's exit status when the address it was told to bind is taken (errno EADDRINUSE on Linux).
EXIT_ADDRESS_IN_USE = 98

# Ports below this are left alone: well-known and registered services (databases, exporters) live there.
LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections' local ports (Linux's default elsewhere)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def is_address_in_use(error: BaseException) -> bool:
    """A bind that failed because something else holds the address (OSError or zmq.ZMQError)."""
    return getattr(error, "errno", None) == errno.EADDRINUSE


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", exclude: set[int] = frozenset()) -> list[int]:
    """`count` distinct ports free now, below the ephemeral range where one is wide enough (else from it).
    Every probe socket stays open until all are chosen, so no two of them are the same port."""
    low, _ = ephemeral_range()
    candidates = range(LOWEST_PORT, low)
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    ports: list[int] = []
    tries = 0
    try:
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            tries += 1
            if len(candidates) >= 1000 and tries <= 50 * count:
                port = rng.choice(candidates)
                if port in exclude or port in ports:
                    continue
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # held by something else, or in TIME_WAIT: try another
            else:
                s.bind((host, 0))  # no room below the range (or it is crowded): the kernel's choice
                port = s.getsockname()[1]
                if port in exclude:
                    continue
            ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()
