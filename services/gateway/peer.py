"""What the gateway's clients of the scheduler and the store share: one DEALER socket to the service, and
two tasks for its life, one reading replies and one pinging (liveness for /ready and lost-peer detection)."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio


class DealerPeer:
    name = "peer"  # names the tasks in asyncio debug output

    def __init__(self, address: str, ctx: zmq.asyncio.Context, identity: str | None = None):
        self.address = address
        self.ctx = ctx
        self.identity = identity
        self.sock = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.identity:
            self.sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._read(), name=f"{self.name}-reader"),
                       asyncio.create_task(self._ping(), name=f"{self.name}-ping")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sock is not None:
            self.sock.close(0)

    async def _read(self) -> None:
        raise NotImplementedError

    async def _ping(self) -> None:
        raise NotImplementedError
