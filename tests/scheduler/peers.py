"""Test-side peers of the scheduler: a gateway and workers played by real ZeroMQ sockets in the test process."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import zmq

from shared.wire import Ping, Pong, SubmitRequest, WorkerStatus, decode, encode


class Peer:
    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.backlog = []

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def recv(self, kind=None, timeout: float = 5.0):
        """The next message (of type `kind` when given; others are kept for later calls)."""
        for i, msg in enumerate(self.backlog):
            if kind is None or isinstance(msg, kind):
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(left * 1000):
                raise TimeoutError(f"no {kind.__name__ if kind else 'message'} within {timeout} s")
            msg = decode(self.sock.recv_multipart())
            if kind is None or isinstance(msg, kind):
                return msg
            self.backlog.append(msg)

    def assigned(self, n: int, timeout: float = 5.0) -> list[str]:
        """Request ids of the next n assignments, however the scheduler split them into Assign messages."""
        from shared.wire import Assign

        ids: list[str] = []
        while len(ids) < n:
            ids += [r.request_id for r in self.recv(Assign, timeout).requests]
        return ids

    def quiet(self, kind, wait: float = 0.3) -> bool:
        """True when no message of `kind` arrives within `wait` seconds."""
        try:
            self.recv(kind, timeout=wait)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.sock.close(0)


def status(worker_id: str, step: int = 0, free_slots: int = 10_000, resident=(), finished=(), running: int = 0,
           waiting: int = 0, max_running: int = 8, ready: bool = True, backlog: int = 0,
           evictable_slots: int = 0) -> WorkerStatus:
    return WorkerStatus(worker_id=worker_id, step=step, total_slots=10_000, free_slots=free_slots, kv_slots=0,
                        adapter_slots=0, running=running, waiting=waiting, resident_adapters=list(resident),
                        finished_request_ids=list(finished), ready=ready, max_running=max_running, backlog=backlog,
                        evictable_slots=evictable_slots)


def submit(rid, adapter=None, prompt=(1, 2, 3), tenant="", max_tokens=4):
    return SubmitRequest(request_id=rid, prompt_ids=np.array(prompt, dtype=np.int32), adapter=adapter,
                         tenant=tenant, max_tokens=max_tokens)


class SchedulerProcess:
    """`python -m services.scheduler` on ipc sockets in a temporary folder."""

    def __init__(self, tmp_path, **options):
        self.gateway_addr = f"ipc://{tmp_path}/gw.sock"
        self.worker_addr = f"ipc://{tmp_path}/wk.sock"
        args = {"gateway_bind": self.gateway_addr, "worker_bind": self.worker_addr, **options}
        argv = [sys.executable, "-m", "services.scheduler"]
        for key, value in args.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.log_path = tmp_path / "scheduler.log"
        self.proc = subprocess.Popen(argv, stderr=open(self.log_path, "w"))
        self.ctx = zmq.Context()
        self.peers = []

    def gateway(self) -> Peer:
        return self._peer(self.gateway_addr)

    def worker(self, worker_id: str, **status_fields) -> Peer:
        peer = self._peer(self.worker_addr)
        peer.worker_id = worker_id
        peer.send(status(worker_id, **status_fields))
        return peer

    def _peer(self, address) -> Peer:
        peer = Peer(self.ctx, address)
        self.peers.append(peer)
        return peer

    def wait_ready(self, timeout: float = 20.0) -> Pong:
        gw = self.gateway()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scheduler exited with {self.proc.returncode}")
            gw.send(Ping(call_id="ready"))
            try:
                return gw.recv(Pong, timeout=0.5)
            except TimeoutError:
                continue
        raise TimeoutError("scheduler not ready")

    def wait_workers(self, gateway: Peer, n: int, timeout: float = 5.0) -> None:
        """Until the scheduler counts n ready workers (their statuses race the gateway's messages)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gateway.send(Ping(call_id="workers"))
            if gateway.recv(Pong).workers_ready == n:
                return
            time.sleep(0.02)
        raise TimeoutError(f"scheduler did not see {n} ready workers")

    def stop(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.ctx.term()
