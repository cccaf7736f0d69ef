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
from contextlib import contextmanager
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


@contextmanager
def exit_if_address_in_use(log, **where):
    """Around a service's binds: one that finds its address taken is logged with `where` and ends the process
    with EXIT_ADDRESS_IN_USE, which tells whoever chose the port (the launcher, the bench stack) to choose
    another. Any other error goes on up."""
    try:
        yield
    except Exception as e:
        if not is_address_in_use(e):
            raise
        log.error("address_in_use", error=str(e), **where)
        raise SystemExit(EXIT_ADDRESS_IN_USE) from None


def listen_socket(host: str, port: int, log) -> socket.socket:
    """An HTTP server's socket, bound before the server starts, so that a taken port ends the process with
    EXIT_ADDRESS_IN_USE (uvicorn, binding it itself, exits 1 for every startup failure)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with exit_if_address_in_use(log, host=host, port=port):
            sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", exclude: set[int] = frozenset()) -> list[int]:
    """`count` distinct ports free now: random ones below the ephemeral range where it leaves room, else (or
    when those keep being taken) the kernel's. Every probe socket stays open until all are chosen, so no two
    of them are the same port."""
    low, _ = ephemeral_range()
    below = range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else range(0)
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(50 * count if below else 0):
            if len(ports) == count:
                break
            port = rng.choice(below)
            if port in exclude or port in ports:
                continue
            s = socket.socket()
            sockets.append(s)
            try:
                s.bind((host, port))
            except OSError:
                continue  # held by something else, or in TIME_WAIT: try another
            ports.append(port)
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()
