"""Blocking client of the adapter store, for workers, the launcher and tests (the gateway uses its own
asyncio socket with the same messages)."""
from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from typing import Iterator

import zmq

from services.gpu_worker.adapter_layout import PackedAdapter
from shared.wire import AcquireAdapter, AdapterLocation, Message, ReleaseAdapter, StoreError, decode, encode

from .arena_reader import attach_arena, location_packed


class StoreCallError(RuntimeError):
    """The store refused a call; carries its StoreError (status, code, message, param)."""

    def __init__(self, error: StoreError):
        super().__init__(f"{error.status} {error.code}: {error.message}")
        self.error = error


class StoreClient:
    def __init__(self, address: str, timeout_s: float = 30.0, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{id(self):x}-"

    def call(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Send a request and wait for the reply carrying its call_id; StoreError replies raise."""
        msg.call_id = self._prefix + str(next(self._ids))
        self.socket.send_multipart(encode(msg), copy=False)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.socket.poll(left_ms):
                raise TimeoutError(f"adapter store did not answer {type(msg).__name__} in time")
            reply = decode(self.socket.recv_multipart())
            if getattr(reply, "call_id", None) != msg.call_id:
                continue  # the late answer of an earlier call that timed out
            if isinstance(reply, StoreError):
                raise StoreCallError(reply)
            return reply

    def send(self, msg: Message) -> None:
        """Fire and forget (WarmAdapters, ReleaseAdapter without call_id)."""
        self.socket.send_multipart(encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close(0)


class ArenaAdapters:
    """A worker's view of the arena: acquire an adapter, read its rows in place, release it."""

    def __init__(self, client: StoreClient, worker_id: str):
        self.client = client
        self.worker_id = worker_id
        self._segments: dict = {}

    def _segment(self, name: str):
        shm = self._segments.get(name)
        if shm is None:
            shm = self._segments[name] = attach_arena(name)
        return shm

    @contextmanager
    def acquired(self, adapter: str) -> Iterator[PackedAdapter]:
        """The adapter's rows as a view of the shared bytes, pinned for the duration of the block."""
        loc = self.client.call(AcquireAdapter(adapter, self.worker_id))
        assert isinstance(loc, AdapterLocation)
        try:
            yield location_packed(self._segment(loc.segment), loc)
        finally:
            self.client.call(ReleaseAdapter(adapter, self.worker_id))

    def load_copy(self, adapter: str) -> PackedAdapter:
        """A private copy of the adapter's rows (for a loader that keeps the rows after the call)."""
        with self.acquired(adapter) as packed:
            packed.rows = packed.rows.clone()
        return packed

    def close(self) -> None:
        for shm in self._segments.values():
            try:
                shm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
        self._segments.clear()
