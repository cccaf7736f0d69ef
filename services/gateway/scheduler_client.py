"""The gateway's side of the scheduler socket: submit, abort, and the stream of events per request.

One DEALER socket; a reader task routes each TokenOutput / RequestRejected to the queue of its request,
and keeps the latest Pong and WorkerStatus (readiness and /metrics). A scheduler that stops answering
pings, or answers from a new process, cannot finish what this gateway sent the old one: every open
request then ends with a clean 503 instead of waiting forever.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from services.gateway.peer import DealerPeer
from shared.log import get_logger
from shared.wire import (
    AbortRequest, Ping, Pong, RequestRejected, SubmitRequest, TokenBatch, TokenOutput, WireError, WorkerStatus,
    decode, encode,
)


@dataclass
class SchedulerView:
    """What the gateway knows of the scheduler and the workers, refreshed by every ping round."""

    pong: Pong | None = None
    pong_at: float = 0.0
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    _round: dict[str, WorkerStatus] = field(default_factory=dict)

    def fresh(self, within_s: float) -> bool:
        return self.pong is not None and time.monotonic() - self.pong_at <= within_s


class SchedulerLost(Exception):
    pass


class SchedulerClient(DealerPeer):
    name = "scheduler"

    def __init__(self, address: str, ctx: zmq.asyncio.Context, ping_interval_s: float = 0.5,
                 lost_after_s: float = 3.0):
        super().__init__(address, ctx, identity=f"gateway-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.ping_interval_s = ping_interval_s
        self.lost_after_s = lost_after_s
        self.log = get_logger("gateway.scheduler_client")
        self.streams: dict[str, asyncio.Queue] = {}
        self.view = SchedulerView()
        self.scheduler_pid: int | None = None
        # Per adapter id ("" = the base model): requests submitted, and the adapter of each open stream (/v1/status).
        self.submitted: Counter[str] = Counter()
        self.adapter_of: dict[str, str] = {}

    @property
    def gateway_id(self) -> str:
        return self.identity

    # ---- requests --------------------------------------------------------------------------------

    def open(self, request_id: str) -> asyncio.Queue:
        """Register before submitting, so no event can arrive for a request nobody listens to."""
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        return queue

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.adapter_of.pop(request_id, None)

    def submit(self, request: SubmitRequest) -> None:
        request.gateway_id = self.gateway_id
        self._send(request)
        self.submitted[request.adapter or ""] += 1
        self.adapter_of[request.request_id] = request.adapter or ""

    def abort(self, request_id: str, reason: str) -> None:
        """Fire and forget, callable from cleanup code that may itself be cancelled."""
        self.forget(request_id)
        self._send(AbortRequest(request_id=request_id, reason=reason))

    def _send(self, msg) -> None:
        # With NOBLOCK the asyncio socket tries the send at once and returns a finished future: a full
        # queue (scheduler gone for long) is an error now rather than a wait.
        done = self.sock.send_multipart(encode(msg), zmq.NOBLOCK)
        if done.done() and done.exception() is not None:
            raise SchedulerLost(f"the scheduler is not accepting requests ({done.exception()})")

    # ---- reader ----------------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except WireError as e:
                self.log.warning("malformed message from scheduler", error=str(e))
                continue
            if isinstance(msg, TokenBatch):
                for out in msg.outputs:
                    self._deliver(out.request_id, out)
            elif isinstance(msg, RequestRejected):
                self._deliver(msg.request_id, msg)
            elif isinstance(msg, WorkerStatus):
                self.view._round[msg.worker_id] = msg
            elif isinstance(msg, Pong):
                self._on_pong(msg)

    def _deliver(self, request_id: str, event: TokenOutput | RequestRejected) -> None:
        queue = self.streams.get(request_id)
        if queue is not None:
            queue.put_nowait(event)

    def _on_pong(self, pong: Pong) -> None:
        if self.scheduler_pid is not None and pong.pid != self.scheduler_pid:
            self._fail_all("the scheduler restarted while this request was in progress")
        self.scheduler_pid = pong.pid
        self.view.pong, self.view.pong_at = pong, time.monotonic()
        self.view.workers, self.view._round = self.view._round, {}

    async def _ping(self) -> None:
        while True:
            try:
                self._send(Ping(call_id="health"))
            except SchedulerLost:
                pass
            await asyncio.sleep(self.ping_interval_s)
            if self.streams and self.view.pong is not None and not self.view.fresh(self.lost_after_s):
                self._fail_all("the scheduler stopped answering")
                self.view.pong = None

    def _fail_all(self, message: str) -> None:
        if self.streams:
            self.log.warning("failing open requests", count=len(self.streams), reason=message)
        for request_id, queue in list(self.streams.items()):
            queue.put_nowait(RequestRejected(request_id=request_id, status=503, code="scheduler_unavailable",
                                             message=message, retry_after=1.0))
            # A submit still queued on this socket reaches the next scheduler process, which would run it for
            # nobody: the abort follows it there.
            try:
                self._send(AbortRequest(request_id=request_id, reason="scheduler_lost"))
            except SchedulerLost:
                pass
