"""Ports a stack chooses for itself, and a stack whose chosen port another process took before it bound it."""
from __future__ import annotations

import socket

import httpx
import pytest

from services.launcher import Launcher
from services.launcher_config import LauncherConfig
from shared.ports import LOWEST_PORT, ephemeral_range, free_port, free_ports


def hold(port: int) -> socket.socket:
    """What another process does with a port it got first: bind it and listen."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_ports_are_distinct_bindable_and_skip_excluded_ones():
    taken = hold(free_port())
    busy = taken.getsockname()[1]
    try:
        for _ in range(100):
            ports = free_ports(6, exclude={busy})
            assert len(set(ports)) == 6 and busy not in ports
        held = [hold(port) for port in free_ports(4)]  # all of them can be bound at once
        for s in held:
            s.close()
    finally:
        taken.close()


def test_ports_are_chosen_where_outgoing_connections_never_take_them():
    low, high = ephemeral_range()
    if low - LOWEST_PORT < 1000:
        pytest.skip(f"ephemeral range {low}-{high} leaves no room below it")
    ports = free_ports(200)
    assert all(LOWEST_PORT <= p < low for p in ports)
    # The local ports of outgoing connections all come from the ephemeral range, none from where ours are.
    server = hold(free_port())
    clients = []
    try:
        for _ in range(50):
            c = socket.create_connection(server.getsockname())
            clients.append(c)
            assert low <= c.getsockname()[1] <= high
    finally:
        for c in clients:
            c.close()
        server.close()


@pytest.mark.parametrize("endpoint", ["redis_url", "store_bind", "scheduler_gateway_bind"])
def test_a_service_whose_port_was_taken_makes_the_launcher_start_again_on_fresh_ports(tmp_path, endpoint):
    launcher = Launcher(LauncherConfig(data_dir=str(tmp_path), device="cpu", port=free_port(), demo_adapters=1,
                                       ready_timeout_s=120))
    launcher.prepare()
    taken = getattr(launcher.topology, endpoint)
    holder = hold(int(taken.rsplit(":", 1)[1].split("/")[0]))
    try:
        first = {c.name: c for c in launcher.children}
        launcher.start_on_free_ports()
        victim = {"redis_url": "redis", "store_bind": "adapter_store"}.get(endpoint, "scheduler")
        # It found its port taken and said so (Redis in its log: it exits 1 for any failure).
        assert first[victim].proc.returncode == (1 if victim == "redis" else 98)
        assert getattr(launcher.topology, endpoint) != taken
        assert all(c.running() for c in launcher.children)
        assert httpx.get(f"{launcher.base_url}/ready", timeout=10).status_code == 200
        with httpx.Client(base_url=launcher.base_url, timeout=60) as client:
            r = client.post("/v1/completions", json={"model": launcher.demo_folders[0].name, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        launcher.stop()
        holder.close()
    assert not any(c.running() for c in launcher.children)
