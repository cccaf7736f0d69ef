"""The gateway's asyncio client of the adapter_store: one DEALER socket, many calls in flight.

Each call carries a fresh call_id; a reader task resolves the future waiting for it. A StoreError reply
becomes an ApiError with the status and message the store chose, so the HTTP answer names the problem.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time

import zmq
import zmq.asyncio

from services.gateway.errors import ApiError
from services.gateway.peer import DealerPeer
from shared.log import get_logger
from shared.wire import Message, Ping, Pong, StoreError, WireError, decode, encode


class StoreClient(DealerPeer):
    name = "store"

    def __init__(self, address: str, ctx: zmq.asyncio.Context, timeout_s: float = 30.0, ping_interval_s: float = 1.0):
        super().__init__(address, ctx)
        self.timeout_s = timeout_s
        self.ping_interval_s = ping_interval_s
        self.log = get_logger("gateway.store_client")
        self.pending: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._prefix = f"gw{os.getpid()}-"
        self.pong: Pong | None = None
        self.pong_at = 0.0

    def fresh(self, within_s: float) -> bool:
        return self.pong is not None and time.monotonic() - self.pong_at <= within_s

    async def call(self, msg: Message, timeout_s: float | None = None) -> Message:
        msg.call_id = self._prefix + str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self.pending[msg.call_id] = future
        try:
            await self.sock.send_multipart(encode(msg), copy=False)
            reply = await asyncio.wait_for(future, self.timeout_s if timeout_s is None else timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, "the adapter store did not answer in time", None, "store_unavailable", retry_after=1) from None
        finally:
            self.pending.pop(msg.call_id, None)
        if isinstance(reply, StoreError):
            raise ApiError(reply.status, reply.message, reply.param, reply.code)
        return reply

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except WireError as e:
                self.log.warning("malformed message from store", error=str(e))
                continue
            if isinstance(msg, Pong) and msg.call_id == "health":
                if self.pong is not None and msg.pid != self.pong.pid:
                    self._fail_pending("the adapter store restarted before answering")
                self.pong, self.pong_at = msg, time.monotonic()
                continue
            future = self.pending.get(getattr(msg, "call_id", ""))
            if future is not None and not future.done():
                future.set_result(msg)

    def _fail_pending(self, message: str) -> None:
        """Calls sent to a store process that is gone will never be answered: fail them now."""
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ApiError(503, message, None, "store_unavailable", retry_after=1))

    async def _ping(self) -> None:
        while True:
            await self.sock.send_multipart(encode(Ping(call_id="health")))
            await asyncio.sleep(self.ping_interval_s)
