"""The gateway's ZeroMQ peers played by the test: a scheduler and an adapter_store on real sockets.

They run in a thread of the test process and answer with scripted behaviour, so HTTP-level behaviour
(validation, streaming, refusals, disconnects) can be checked against a real gateway process before the
real services exist side by side. Every message they receive is recorded for assertions.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np
import zmq

from shared.ports import free_port
from shared.wire import (
    AbortRequest, AdapterCard, AdapterDeleted, AdapterList, AdapterRegistered, DeleteAdapter, GetAdapter,
    ListAdapters, Ping, Pong, RegisterAdapter, StoreError, SubmitRequest, TokenBatch, TokenOutput,
    WorkerStatus, decode, encode,
)


def card(name: str, tenant: str = "", rank: int = 8, host: bool = False, status: str = "ready") -> AdapterCard:
    return AdapterCard(id=f"{tenant + ':' if tenant else ''}{name}@0123456789abcdef", name=name, tenant=tenant,
                       rank=rank, target_modules=["q_proj", "v_proj"], sha256="0123456789abcdef" * 4, bytes=1234,
                       created=1700000000.0, status=status, host_resident=host)


class FakePeers:
    """A fake scheduler and a fake adapter_store on ipc sockets, served by one background thread."""

    def __init__(self, folder):
        self.scheduler_addr = f"ipc://{folder}/sched.sock"
        self.store_addr = f"ipc://{folder}/store.sock"
        self.ctx = zmq.Context()
        self.sched = self.ctx.socket(zmq.ROUTER)
        self.sched.bind(self.scheduler_addr)
        self.store = self.ctx.socket(zmq.ROUTER)
        self.store.bind(self.store_addr)
        self.lock = threading.Lock()
        self.reset()
        self.stop_flag = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        with self.lock:
            self.submits: list[SubmitRequest] = []
            self.aborts: list[AbortRequest] = []
            self.store_calls: list = []
            self.cards: dict[tuple[str, str], AdapterCard] = {}
            self.resident: list[str] = []
            self.scheduler_answers = True
            self.store_pid = os.getpid()
            self.store_holds: tuple = ()  # store request types left unanswered, as by a store that died
            self.workers_ready = 1
            # request -> list of (delay_s, event) where event is a TokenOutput or a RequestRejected
            self.script = lambda submit: [(0.0, TokenOutput(submit.request_id, np.array([5, 6], np.int32), True, "length"))]
            self.outbox: deque = deque()

    # ---- the thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sched, zmq.POLLIN)
        poller.register(self.store, zmq.POLLIN)
        while not self.stop_flag:
            events = dict(poller.poll(10))
            if self.sched in events:
                ident, *frames = self.sched.recv_multipart()
                self._on_scheduler(ident, decode(frames))
            if self.store in events:
                ident, *frames = self.store.recv_multipart()
                reply = self._on_store(decode(frames))
                if reply is not None:
                    self.store.send_multipart([ident, *encode(reply)])
            now = time.monotonic()
            with self.lock:
                due = [item for item in self.outbox if item[0] <= now]
                for item in due:
                    self.outbox.remove(item)
            for _, ident, msg in due:
                self.sched.send_multipart([ident, *encode(msg)])

    def _on_scheduler(self, ident: bytes, msg) -> None:
        with self.lock:
            if isinstance(msg, Ping):
                if self.scheduler_answers:
                    status = WorkerStatus("w0", 1, 1000, 900, 60, 40, 2, 1, list(self.resident), [],
                                          adapter_loads=3, adapter_load_bytes=4096)
                    self.sched.send_multipart([ident, *encode(status)])
                    pong = Pong("scheduler", True, os.getpid(), msg.call_id, workers_ready=self.workers_ready, queue_depth=7,
                                newest_first=True, prefill_estimate_s=1.25)
                    self.sched.send_multipart([ident, *encode(pong)])
            elif isinstance(msg, SubmitRequest):
                self.submits.append(msg)
                at = time.monotonic()
                for delay, event in self.script(msg):
                    at += delay
                    wrapped = TokenBatch("w0", [event]) if isinstance(event, TokenOutput) else event
                    self.outbox.append((at, ident, wrapped))
            elif isinstance(msg, AbortRequest):
                self.aborts.append(msg)
                # The request is gone: drop whatever was still scheduled for it, as a worker would.
                for item in list(self.outbox):
                    target = item[2]
                    rid = target.outputs[0].request_id if isinstance(target, TokenBatch) else target.request_id
                    if rid == msg.request_id:
                        self.outbox.remove(item)

    def _on_store(self, msg):
        with self.lock:
            self.store_calls.append(msg)
            if isinstance(msg, Ping):
                return Pong("adapter_store", True, self.store_pid, msg.call_id)
            if isinstance(msg, self.store_holds):
                return None
            if isinstance(msg, GetAdapter):
                found = self.cards.get((msg.tenant, msg.name)) or self.cards.get(("", msg.name))
                if found is None:
                    return StoreError(404, "adapter_not_found", f"adapter {msg.name!r} not found", "name", call_id=msg.call_id)
                return _with_call(found, msg.call_id)
            if isinstance(msg, ListAdapters):
                cards = [c for (t, _), c in self.cards.items() if msg.all_tenants or t in ("", msg.tenant)]
                return AdapterList(cards, call_id=msg.call_id)
            if isinstance(msg, RegisterAdapter):
                new = card(msg.name, msg.tenant)
                created = (msg.tenant, msg.name) not in self.cards
                self.cards[(msg.tenant, msg.name)] = new
                return AdapterRegistered(new, created, call_id=msg.call_id)
            if isinstance(msg, DeleteAdapter):
                if self.cards.pop((msg.tenant, msg.name), None) is None:
                    return StoreError(404, "adapter_not_found", f"adapter {msg.name!r} not found", "name", call_id=msg.call_id)
                return AdapterDeleted(msg.name, msg.tenant, call_id=msg.call_id)
            return StoreError(400, "unsupported_message", type(msg).__name__, call_id=getattr(msg, "call_id", ""))

    def wait_for(self, predicate, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                value = predicate()
            if value:
                return value
            time.sleep(0.01)
        raise TimeoutError("condition not met in time")

    def close(self) -> None:
        self.stop_flag = True
        self.thread.join()
        self.sched.close(0)
        self.store.close(0)
        self.ctx.term()


def _with_call(c: AdapterCard, call_id: str) -> AdapterCard:
    copy = AdapterCard(**{**c.__dict__, "call_id": call_id})
    return copy


class GatewayProcess:
    """`python -m services.gateway` against the fake peers, on a free local port."""

    def __init__(self, folder, model_dir, peers: FakePeers, **options):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = {"model_dir": model_dir, "served_model_name": "tiny", "scheduler_addr": peers.scheduler_addr,
                "store_addr": peers.store_addr, "port": self.port, "ping_interval_s": 0.1, **options}
        argv = [sys.executable, "-m", "services.gateway"]
        for key, value in args.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.log_path = folder / f"gateway-{self.port}.log"
        self.proc = subprocess.Popen(argv, stderr=open(self.log_path, "w"))

    def wait_ready(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"gateway not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
