"""The worker's side of the host adapter arena: acquire an adapter from the adapter_store and view its
rows in shared memory without copying them.

The store answers AcquireAdapter with where the adapter's pool-format rows sit in its shared-memory arena;
the bytes stay put until the matching ReleaseAdapter. The worker maps each arena segment once for its
whole life (the views handed to the engine export the segment's buffer, so it could not be closed early
anyway) and, on CUDA, registers it as pinned memory so the engine's host-to-device copy is a DMA transfer
at full bandwidth instead of a staged pageable copy.

Acquires are asynchronous underneath: a prefetch hint starts one and the loop goes on stepping while the
store reads the adapter from disk; the engine's own (blocking) load of that adapter then finds it done.
"""
from __future__ import annotations

import ctypes
import time
import uuid

import torch
import zmq

from services.adapter_store.arena_reader import attach_arena, location_packed
from shared.log import get_logger
from shared.model_config import MODULES
from shared.wire import (AcquireAdapter, AdapterLocation, Message, Ping, Pong, ReleaseAdapter, ReleaseWorker,
                         StoreError, WireError, decode, encode)

from .adapter_layout import PackedAdapter
from .page_populate import BackgroundPopulate

log = get_logger(__name__)
# `ready` reads the store's socket at most this often (it is asked once per waiting request per step).
READY_POLL_S = 0.001
# How long a request waits before asking again for an adapter the arena had no room for (pins come back
# as copies end, within a step or two).
ARENA_FULL_RETRY_S = 0.2


class AdapterUnavailable(ValueError):
    """The store could not hand out an adapter (down, timed out, arena full). The engine fails the request
    that needed it with this message; it is a ValueError so the engine treats it like any bad adapter.
    `code` is the store's error code when it answered (e.g. arena_full, which passes)."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class ArenaSegments:
    """Arena segments mapped into this process, each attached once and kept until close().

    Pinning (cudaHostRegister) a segment faults in and locks every page of it: seconds for tens of GiB,
    during which the worker's loop would be silent and its supervisor would take it for hung. So the
    segment is pinned while the worker starts (`pin_at_start`, before it reports ready), its pages
    populated beforehand on other threads while the engine warms up (`populate_at_start`); one first seen
    later (an adapter_store restarted under another segment name) is only mapped, and copies from it are
    staged pageable copies until the worker restarts.
    """

    def __init__(self, register_with_cuda: bool):
        self.register_with_cuda = register_with_cuda
        self._segments: dict = {}
        self._registered: list[int] = []
        self._populating: dict[str, BackgroundPopulate] = {}
        self._pinned: set[str] = set()

    def populate_at_start(self, name: str) -> None:
        """Start faulting in the segment's pages (no CUDA call: safe beside graph capture)."""
        if name and name not in self._populating and name not in self._pinned:
            self._populating[name] = BackgroundPopulate(name, self._mapped(name).buf)

    def pin_at_start(self, name: str) -> None:
        if not name or name in self._pinned:
            return
        pending = self._populating.pop(name, None)
        if pending is not None:
            pending.wait()
        shm = self._mapped(name)
        self._pinned.add(name)
        if self.register_with_cuda:
            self._pin(name, shm)

    def _mapped(self, name: str):
        return self._segments.get(name) or self._attach(name)

    def get(self, name: str):
        shm = self._segments.get(name)
        if shm is None:
            shm = self._attach(name)
            if self.register_with_cuda:
                log.warning("arena.not_pinned", segment=name,
                            reason="first seen after start: adapter copies from it are pageable until a restart")
        return shm

    def _attach(self, name: str):
        try:
            shm = attach_arena(name)
        except FileNotFoundError:
            raise AdapterUnavailable(f"arena segment {name!r} does not exist on this host") from None
        self._segments[name] = shm
        return shm

    def _pin(self, name: str, shm) -> None:
        """cudaHostRegister the whole segment; failure only costs bandwidth, so it is logged, not fatal."""
        started = time.monotonic()
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
        try:
            err = torch.cuda.cudart().cudaHostRegister(ptr, shm.size, 0)
        except Exception as e:  # no CUDA runtime bindings in this build
            log.warning("arena.pin_failed", segment=name, error=str(e))
            return
        code = int(getattr(err, "value", err))
        if code != 0:
            log.warning("arena.pin_failed", segment=name, cuda_error=code)
            return
        self._registered.append(ptr)
        log.info("arena.pinned", segment=name, bytes=shm.size, seconds=round(time.monotonic() - started, 2))

    def close(self) -> None:
        for pending in self._populating.values():  # its pages must stay mapped while it runs
            pending.wait()
        self._populating.clear()
        for ptr in self._registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:
                pass
        self._registered.clear()
        for shm in self._segments.values():
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        self._segments.clear()


class StoreClient:
    """AcquireAdapter / ReleaseAdapter over one DEALER socket, used only from the worker's loop thread.

    Calls are started with `start` and collected with `wait` (blocking) or `poll` (not blocking), so several
    can be in flight at once.
    """

    def __init__(self, ctx: zmq.Context, addr: str, worker_id: str, timeout_s: float):
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.results: dict[str, Message] = {}
        self.in_flight: dict[str, str] = {}  # call_id -> adapter
        self.abandoned: set[str] = set()  # calls that timed out; their late pins are given back
        # When the store last answered anything: a store that answers others is alive, only busy.
        self.answered_at = time.monotonic()
        # A fresh process holds no pins, whatever an earlier process of this worker id held; said before
        # any acquire on this socket, so the store cannot drop a pin taken by this process.
        self.sock.send_multipart(encode(ReleaseWorker(worker_id=worker_id)))

    def arena_name(self, timeout_s: float) -> str:
        """The store's arena segment name ("" when the store does not answer in time; the worker then maps
        the segment on its first adapter, unpinned)."""
        call_id = uuid.uuid4().hex
        self.sock.send_multipart(encode(Ping(call_id=call_id)))
        self.in_flight[call_id] = ""
        deadline = time.monotonic() + timeout_s
        while call_id not in self.results and (left := deadline - time.monotonic()) > 0:
            self.poll(left)
        reply = self.results.pop(call_id, None)
        if reply is None:
            self.abandoned.add(call_id)
        return reply.arena_name if isinstance(reply, Pong) else ""

    def start(self, adapter: str) -> str:
        call_id = uuid.uuid4().hex
        self.sock.send_multipart(encode(AcquireAdapter(adapter=adapter, worker_id=self.worker_id, call_id=call_id)))
        self.in_flight[call_id] = adapter
        return call_id

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect the replies that are here (waiting up to timeout_s for the first)."""
        wait_ms = int(timeout_s * 1000)
        while self.sock.poll(wait_ms):
            wait_ms = 0
            self.answered_at = time.monotonic()
            try:
                reply = decode(self.sock.recv_multipart(copy=False))
            except WireError as e:
                log.error("store.bad_reply", error=str(e))
                continue
            call_id = getattr(reply, "call_id", "")
            adapter = self.in_flight.pop(call_id, None)
            if adapter is None:
                continue
            if call_id in self.abandoned:
                self.abandoned.discard(call_id)
                if isinstance(reply, AdapterLocation):
                    self.release(adapter)  # answer to a call that timed out: nobody holds this pin
                continue
            self.results[call_id] = reply

    def wait(self, call_id: str) -> AdapterLocation:
        deadline = time.monotonic() + self.timeout_s
        while call_id not in self.results:
            left = deadline - time.monotonic()
            if left <= 0:
                self.abandoned.add(call_id)
                raise AdapterUnavailable(f"adapter store did not answer within {self.timeout_s:g}s")
            self.poll(left)
        return self.result(call_id)

    def result(self, call_id: str) -> AdapterLocation:
        reply = self.results.pop(call_id)
        if isinstance(reply, AdapterLocation):
            return reply
        if isinstance(reply, StoreError):
            if reply.status == 404:
                raise KeyError(reply.message)
            raise AdapterUnavailable(reply.message, reply.code)
        raise AdapterUnavailable(f"unexpected reply {type(reply).__name__} to AcquireAdapter")

    def release(self, adapter: str) -> None:
        # No call_id: the store does not answer, so the loop never waits on a release.
        self.sock.send_multipart(encode(ReleaseAdapter(adapter=adapter, worker_id=self.worker_id)))

    def close(self) -> None:
        self.sock.close(0)


class ArenaAdapterLoader:
    """The engine's `adapter_loader`: adapter id -> PackedAdapter whose rows are the arena bytes.

    Invariant: this worker holds exactly one store pin per entry of `pinned`. `release_evicted` drops the
    pins of adapters the engine no longer reads (resident copies need none, once copied) and of prefetched
    ones never used in time, so the store may evict or delete them.
    """

    def __init__(self, store: StoreClient, segments: ArenaSegments, num_layers: int, slot_width: int,
                 prefetch_ttl_s: float = 30.0, load_timeout_s: float = 120.0, clock=time.monotonic):
        self.store = store
        self.load_timeout_s = load_timeout_s
        self.segments = segments
        self.num_layers = num_layers
        self.slot_width = slot_width
        self.prefetch_ttl_s = prefetch_ttl_s
        self.clock = clock
        # The engine may ask again for an adapter it could not fit yet; the pinned bytes have not moved,
        # so the same view is handed out without a second pin.
        self.pinned: dict[str, PackedAdapter] = {}
        # adapter -> (call_id, when it was sent) of an acquire not answered yet
        self.pending: dict[str, tuple[str, float]] = {}
        self.prefetched: dict[str, float] = {}  # adapter -> time its unused prefetch pin lapses
        # What the store said (or failed to say in time) to an acquire `ready` started: the engine's next
        # load of that adapter raises it, so its request fails with the store's reason, without a second wait.
        self.failed: dict[str, Exception] = {}
        self.retry_at: dict[str, float] = {}  # adapter -> when to ask again after the arena was full
        self._polled_at = float("-inf")

    def __call__(self, adapter: str) -> PackedAdapter:
        failure = self.failed.pop(adapter, None)
        if failure is not None:
            raise failure
        packed = self.pinned.get(adapter)
        if packed is None:
            call_id = self.pending.pop(adapter, (None, 0.0))[0] or self.store.start(adapter)
            packed = self._pin(adapter, self.store.wait(call_id))
        self.prefetched.pop(adapter, None)
        return packed

    def ready(self, adapter: str) -> bool:
        """Whether `self(adapter)` would return without waiting on the store. If not, its acquire is started
        (or left running), so the engine can admit other requests meanwhile and ask again at its next step:
        a step never waits on the disk reads of adapters that are not in the host arena yet."""
        if adapter in self.pinned or adapter in self.failed:
            return True
        call_id, sent_at = self.pending.get(adapter, (None, 0.0))
        if call_id is None:
            # The arena was full a moment ago: asking at every step would only have the store read the
            # adapter from disk again and again for nothing.
            if self.clock() < self.retry_at.get(adapter, 0.0):
                return False
            self.retry_at.pop(adapter, None)
            self.prefetch(adapter)
            return False
        if call_id not in self.store.results:
            now = self.clock()
            if now - self._polled_at >= READY_POLL_S:  # many waiting requests asked in one step: read once
                self._polled_at = now
                self.store.poll(0.0)
            if call_id not in self.store.results:
                reason = self._overdue(now - sent_at)
                if reason:  # lost with a store that died, or stuck: give up on it
                    del self.pending[adapter]
                    self.store.abandoned.add(call_id)
                    self.failed[adapter] = AdapterUnavailable(reason)
                    return True
                return False
        error = self._settle(adapter, call_id)
        if getattr(error, "code", "") == "arena_full":
            # Every arena byte is pinned by adapters being read. Our unused prefetches may be among them:
            # give them back, and ask again shortly instead of failing the request.
            self._release_prefetched()
            self.retry_at[adapter] = self.clock() + ARENA_FULL_RETRY_S
            return False
        if error is not None:
            self.failed[adapter] = error  # the engine's load raises it: the request fails with this reason
        return True

    def _overdue(self, waited: float) -> str:
        """Why a started acquire is given up on ("" while it may still come). A busy store answers in turn:
        loads from disk queue behind each other when many adapters miss the arena at once, so an acquire
        waits as long as the store keeps answering other calls, up to `load_timeout_s`; it fails after
        the acquire timeout only when the store has answered nothing for that long (died or stuck)."""
        if waited <= self.store.timeout_s:
            return ""
        if time.monotonic() - self.store.answered_at > self.store.timeout_s:
            return f"adapter store did not answer within {self.store.timeout_s:g}s"
        if waited > self.load_timeout_s:
            return f"adapter store did not hand the adapter out within {self.load_timeout_s:g}s"
        return ""

    def _settle(self, adapter: str, call_id: str) -> Exception | None:
        """Take the store's answer to a started acquire: the adapter pinned and held as a prefetch until the
        engine takes it or its grace period lapses, or why it could not be."""
        del self.pending[adapter]
        try:
            self._pin(adapter, self.store.result(call_id))
        except (KeyError, ValueError) as e:
            return e
        self.prefetched[adapter] = self.clock() + self.prefetch_ttl_s
        return None

    def _release_prefetched(self) -> None:
        for adapter in list(self.prefetched):
            del self.prefetched[adapter]
            if self.pinned.pop(adapter, None) is not None:
                self.store.release(adapter)

    def prefetch(self, adapter: str) -> None:
        """Start acquiring an adapter without waiting; `collect` picks up the answer."""
        if adapter not in self.pinned and adapter not in self.pending:
            self.pending[adapter] = (self.store.start(adapter), self.clock())

    def collect(self) -> list[str]:
        """Pin the prefetches the store has answered; returns the adapters now ready to copy."""
        if not self.pending:
            return []
        self.store.poll(0.0)
        ready = []
        for adapter, (call_id, _) in list(self.pending.items()):
            if call_id not in self.store.results:
                continue
            error = self._settle(adapter, call_id)
            if error is not None:
                log.info("worker.prefetch_failed", adapter=adapter, error=str(error))
                continue
            ready.append(adapter)
        return ready

    def _pin(self, adapter: str, loc: AdapterLocation) -> PackedAdapter:
        try:
            packed = location_packed(self.segments.get(loc.segment), self._checked(loc))
        except Exception:
            self.store.release(adapter)
            raise
        self.pinned[adapter] = packed
        return packed

    def _checked(self, loc: AdapterLocation) -> AdapterLocation:
        """Refuse a location that does not fit this engine, instead of reading garbage rows."""
        shm = self.segments.get(loc.segment)
        problems = []
        if len(loc.shape) != 4 or loc.shape[0] != self.num_layers or loc.shape[1] != 2 or loc.shape[3] != self.slot_width:
            problems.append(f"rows shape {loc.shape} is not [{self.num_layers}, 2, n, {self.slot_width}]")
        dtype = getattr(torch, loc.dtype, None)
        if not isinstance(dtype, torch.dtype):
            problems.append(f"unknown dtype {loc.dtype!r}")
        else:
            itemsize = torch.empty((), dtype=dtype).element_size()
            count = 1
            for d in loc.shape:
                count *= d
            if count * itemsize != loc.nbytes:
                problems.append(f"{loc.nbytes} bytes do not hold shape {loc.shape} of {loc.dtype}")
            if loc.offset % itemsize:
                problems.append(f"offset {loc.offset} is not aligned to {loc.dtype}")
        if loc.offset < 0 or loc.offset + loc.nbytes > shm.size:
            problems.append(f"bytes [{loc.offset}, {loc.offset + loc.nbytes}) lie outside the arena ({shm.size} bytes)")
        if not (len(loc.ranks) == len(loc.a_off) == len(loc.b_off) == len(MODULES)):
            problems.append(f"ranks/a_off/b_off need {len(MODULES)} entries each")
        if problems:
            raise AdapterUnavailable(f"arena location of {loc.adapter!r} is unusable: {'; '.join(problems)}")
        return loc

    def release_evicted(self, resident) -> list[str]:
        """Release every pinned adapter the engine no longer reads, `resident` being those it still may
        (prefetched ones once their grace period lapses unused)."""
        now = self.clock()
        gone = [a for a in self.pinned if a not in resident and self.prefetched.get(a, now) <= now]
        for adapter in gone:
            del self.pinned[adapter]
            self.prefetched.pop(adapter, None)
            self.store.release(adapter)
        return gone

    def release_all(self) -> None:
        for adapter in self.pinned:
            self.store.release(adapter)
        self.pinned.clear()
        self.prefetched.clear()
