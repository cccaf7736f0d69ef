"""Control channel between rank 0 and its followers (ZeroMQ ROUTER on rank 0, one DEALER per follower).

It carries startup handshakes, step plans and adapter shards, never model activations (those go through
torch.distributed). Kept apart from the collectives' process group on purpose: a follower waiting for the
next plan while the server is idle must not run into a collective timeout, and it can poll, so it notices
when rank 0 is gone.
"""
from __future__ import annotations

import zmq


def identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LeaderChannel:
    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1"):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Sending to a follower that never connected (or left) is an error, not a silent drop.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.bytes_sent = 0

    def send(self, rank: int, kind: bytes, *frames) -> None:
        self.bytes_sent += sum(len(f) for f in frames)
        self.sock.send_multipart([identity(rank), kind, *frames], copy=False)

    def recv(self, timeout_ms: int) -> tuple[int, bytes, list[bytes]] | None:
        """(rank, kind, frames) of the next follower message, or None after `timeout_ms`."""
        if not self.sock.poll(timeout_ms):
            return None
        ident, kind, *frames = self.sock.recv_multipart()
        return int(ident.decode().split("-", 1)[1]), kind, frames

    def close(self) -> None:
        self.sock.close(0)


class FollowerChannel:
    def __init__(self, ctx: zmq.Context, address: str, rank: int):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # let a last error report reach rank 0
        self.sock.setsockopt(zmq.IDENTITY, identity(rank))
        self.sock.connect(address)

    def send(self, kind: bytes, *frames: bytes) -> None:
        self.sock.send_multipart([kind, *frames])

    def recv(self, timeout_ms: int) -> tuple[bytes, list] | None:
        if not self.sock.poll(timeout_ms):
            return None
        kind, *frames = self.sock.recv_multipart(copy=False)
        return kind.bytes, frames

    def close(self) -> None:
        self.sock.close()
