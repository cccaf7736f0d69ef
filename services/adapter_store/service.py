"""The adapter_store process: a ZeroMQ ROUTER socket in front of AdapterStore.

Clients (gateway, workers, scheduler) talk to it over DEALER sockets: [type, payload, ...] in, the reply
out to the same identity. The dispatch table below is the store's whole protocol. The loop is
    1) answer every waiting message; a registration's reading, hashing and checks go to a thread pool
    2) answer the registrations the pool has finished
    3) when idle, load one prefetched adapter  4) repeat
so lookups, acquires and releases are answered while a bulk registration runs, registrations run side by
side, and prefetch work never delays any of them by more than one adapter load.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Callable

import torch
import zmq

from shared.log import configure_logging, get_logger
from shared.model_config import ModelConfig
from shared.ports import exit_if_address_in_use
from shared.wire import (
    AcquireAdapter, DeleteAdapter, GetAdapter, ListAdapters, Message, Ping, Pong, RegisterAdapter,
    ReleaseAdapter, ReleaseWorker, StoreError, WarmAdapters, WireError, decode, encode,
)

from .arena import Arena, unlink_stale_segment
from .blobs import BlobStore
from .config import StoreConfig
from .errors import StoreRefusal
from .offload import Join, Offload, Offloaded
from .registry import Registry
from .store import AdapterStore

log = get_logger("adapter_store")
IDLE_POLL_MS = 100
# Messages answered before finished registrations get their turn, so a busy socket cannot starve them.
BATCH = 256
# Finished pieces of work answered per pass of the loop (a registration's or a hint's may copy an adapter of
# up to ~134 MB into the arena): then the socket's messages (releases, pings, arena hits) get their turn again.
FINISHED_PER_PASS = 4
# The launcher starts Redis first, but it may still be loading its AOF when the store comes up.
REDIS_WAIT_S = 30.0


class StoreService:
    def __init__(self, cfg: StoreConfig):
        if not cfg.model_dir:
            raise ValueError("model_dir is required: adapters are checked against the base model's geometry")
        self.cfg = cfg
        # One thread per tensor op: registrations run side by side on the pool instead. torch's own intra-op
        # threads, one team per calling thread, spin against the pool and the other services on the machine
        # (a bulk registration ran 6-10x slower with them on a busy machine).
        torch.set_num_threads(1)
        if cfg.allowed_root and not Path(cfg.allowed_root).is_dir():
            raise ValueError(f"allowed_root {cfg.allowed_root!r} is not a folder")
        model = ModelConfig.from_dir(cfg.model_dir)
        registry = Registry(cfg.redis_url, cfg.key_prefix)
        registry.wait_until_reachable(REDIS_WAIT_S)
        if cfg.require_durable_redis:
            registry.check_durable()
        arena_name = cfg.arena_name
        if not arena_name:
            arena_name = f"loraplex-arena-{os.getpid()}"  # our pid: a segment by this name is a dead store's
            if unlink_stale_segment(arena_name):
                log.warning("arena.stale_segment_removed", segment=arena_name)
        self.arena = Arena(cfg.arena_bytes, arena_name)
        self.store = AdapterStore(cfg, registry, BlobStore(cfg.data_dir), self.arena, model)
        self.offloads = {"register": Offload(cfg.registration_threads, "register"),
                         "load": Offload(cfg.load_threads, "load")}
        self.handlers: dict[type, Callable[[Message], Message | Offloaded | Join | None]] = {
            RegisterAdapter: self.store.register,
            ListAdapters: self.store.list,
            GetAdapter: self.store.get,
            DeleteAdapter: self.store.delete,
            AcquireAdapter: self.store.acquire,
            ReleaseAdapter: self.store.release,
            ReleaseWorker: self.store.release_worker,
            WarmAdapters: self.store.warm,
            Ping: self.ping,
        }
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        # Only a guard against absurd frames: uploads over the cap but under this still get a clean 413.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_upload_bytes + 16 * 2**20)
        self.running = True
        self.warming = False  # a hinted load is on the load threads

    def ping(self, msg: Ping) -> Pong:
        arena = self.arena
        return Pong("adapter_store", ready=True, pid=os.getpid(), call_id=msg.call_id,
                    arena_capacity_bytes=arena.capacity, arena_used_bytes=arena.used_bytes,
                    arena_pinned_bytes=arena.pinned_bytes, arena_adapters=len(arena), arena_pins=arena.pin_count,
                    arena_name=arena.name, arena_loads=arena.loads, arena_evictions=arena.evictions,
                    blob_reads=self.store.blob_reads, packed_reads=self.store.packed_reads)

    def handle(self, identity, frames: list) -> list | None:
        """Reply frames for one request's frames (identity stripped), or None for no reply now (none at all,
        or one sent when its offloaded work is done)."""
        try:
            msg = decode(frames)
        except WireError as e:
            log.warning("bad_message", error=str(e))
            return encode(StoreError(400, "bad_message", str(e)))
        handler = self.handlers.get(type(msg))
        if handler is None:
            return encode(StoreError(400, "unsupported_message", f"the adapter store does not handle {type(msg).__name__}",
                                     call_id=getattr(msg, "call_id", "")))
        return self._dispatch(identity, msg, self._answer(msg, lambda: handler(msg)))

    def _dispatch(self, identity, msg: Message, reply: list | Offloaded | Join | None) -> list | None:
        """Reply frames to send now, or None when the answer comes later (offloaded work, or a joined read)."""
        if isinstance(reply, Offloaded):
            self.offloads[reply.pool].submit(reply.work, lambda done: self._completed(identity, msg, reply, done))
            return None
        if isinstance(reply, Join):
            self.store.loading.setdefault(reply.adapter, []).append((identity, msg))
            return None
        return reply

    def _completed(self, identity, msg: Message, work: Offloaded, done) -> None:
        """On the loop: answer offloaded work, then the acquires that joined its reads (asked again: the
        adapter is in the arena now, or its read failed and they start their own)."""
        self._send(identity, self._answer(msg, lambda: work.finish(done.result())))
        self._rejoin(work.reads)

    def _rejoin(self, reads: tuple[str, ...]) -> None:
        for identity, msg in self.store.settle(reads):
            if not self.running:  # the pools are closing: nothing new may start
                self._send(identity, encode(StoreError(503, "store_stopping", "the adapter store stopped before "
                                                       "handling this", call_id=getattr(msg, "call_id", ""))))
                continue
            handler = self.handlers[type(msg)]
            self._send(identity, self._dispatch(identity, msg, self._answer(msg, lambda: handler(msg))))

    def _answer(self, msg: Message, call: Callable[[], Message | Offloaded | None]) -> list | Offloaded | None:
        """Encoded reply of a handler call, its refusal as a StoreError, or the Offloaded it returned."""
        call_id = getattr(msg, "call_id", "")
        try:
            reply = call()
        except StoreRefusal as e:
            log.info("refused", message=type(msg).__name__, status=e.status, code=e.code, reason=e.message)
            return encode(StoreError(e.status, e.code, e.message, e.param, call_id=call_id))
        except CancelledError:
            return encode(StoreError(503, "store_stopping", "the adapter store stopped before handling this", call_id=call_id))
        except Exception as e:  # a bug must cost one request, not the store
            log.exception("handler_failed", message=type(msg).__name__)
            return encode(StoreError(500, "internal_error", f"{type(e).__name__}: {e}", call_id=call_id))
        if reply is None or isinstance(reply, (Offloaded, Join)):
            return reply
        return encode(reply)

    def _send(self, identity, reply: list | None) -> None:
        if reply is not None:
            self.socket.send_multipart([identity, *reply], copy=False)

    def serve(self) -> None:
        self.store.reconcile()
        self.socket.bind(self.cfg.bind)
        log.info("ready", bind=self.cfg.bind, arena=self.arena.name, arena_bytes=self.arena.capacity,
                 registration_threads=self.cfg.registration_threads, pid=os.getpid())
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        for offload in self.offloads.values():
            poller.register(offload.fd, zmq.POLLIN)
        while self.running:
            timeout = 0 if self.store.warm_queue and not self.warming else IDLE_POLL_MS
            ready = dict(poller.poll(timeout))
            if not ready:
                # 3) idle: start loading the next prefetched adapter
                self._warm_next()
                continue
            # 1) answer everything waiting
            for _ in range(BATCH if self.socket in ready else 0):
                try:
                    identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._send(identity, self.handle(identity, frames))
                if not self.running:
                    break
            # 2) answer finished registrations and loads, a few at a time: the socket's turn comes between
            for offload in self.offloads.values():
                offload.run_finished(FINISHED_PER_PASS)

    def _warm_next(self) -> None:
        """One hinted load at a time, on the load threads: hints are guesses, so they never take more than
        one of the threads that workers' acquires need."""
        if self.warming:
            return
        try:
            work = self.store.next_warm()
        except Exception:  # a prefetch is only a hint: drop the rest of it
            log.exception("warm_failed")
            self.store.warm_queue.clear()
            return
        if work is not None:
            self.warming = True
            self.offloads[work.pool].submit(work.work, lambda done: self._warmed(work, done))

    def _warmed(self, work: Offloaded, done) -> None:
        self.warming = False
        try:
            work.finish(done.result())
        except Exception as e:  # e.g. deleted or unreadable meanwhile, Redis briefly away: only a hint
            log.info("warm_failed", error=f"{type(e).__name__}: {e}")
            self.store.warm_queue.clear()
        self._rejoin(work.reads)

    def stop(self, *_args) -> None:
        self.running = False

    def close(self) -> None:
        self.running = False  # work finishing below answers its joiners without starting more
        for offload in self.offloads.values():
            offload.close()  # registrations and loads under way finish and are answered
        self.socket.close()
        self.ctx.term()
        self.arena.close()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    cfg = StoreConfig.from_args(argv)
    configure_logging()
    try:
        service = StoreService(cfg)
    except Exception as e:
        log.error("startup_failed", error=str(e))
        return 1
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    try:
        with exit_if_address_in_use(log, bind=cfg.bind):  # serve() binds first
            service.serve()
    finally:
        service.close()
    return 0
