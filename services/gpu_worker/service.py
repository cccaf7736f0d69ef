"""The gpu_worker process: the engine behind a ZeroMQ loop.

    1) drain   Assign / WorkerAbort / PrefetchHint from the scheduler, adapter locations from the store
    2) step    one engine step (prefill and decode of every running request)
    3) emit    one TokenBatch with every request's new tokens, then WorkerStatus (capacity, residency,
               finished ids) so the scheduler can route and admit; while idle, WorkerStatus is the heartbeat

The protocol of the process is the dispatch table in `WorkerService.handlers`. A request the engine refuses
(bad adapter, too long for the pool) ends with an error entry in the TokenBatch; the worker keeps serving.
Only an exception out of the engine's step is fatal: every request it held gets a clean error, then the
process exits and the supervisor restarts it with an empty pool.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq

from shared.log import get_logger
from shared.wire import (Assign, Message, PrefetchHint, SubmitRequest, TokenBatch, TokenOutput, WireError,
                         WorkerAbort, WorkerStatus, decode, encode)

from .arena_client import ArenaAdapterLoader
from .requests import EngineRequest, RequestOutput
from .sampling import SamplingParams
from .worker_config import WorkerConfig

log = get_logger(__name__)

# Most Assign/Abort messages drained in one pass, so a flood cannot starve the running batch of steps.
MAX_DRAIN = 256
# How long an idle loop waits for messages while the store is still answering adapter acquires.
ADAPTER_POLL_S = 0.002


def engine_request(req: SubmitRequest) -> EngineRequest:
    """The engine's view of a wire request. The wire's top_k -1 (and 0) mean no cut, the engine's 0."""
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(0, req.top_k),
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
    )
    return EngineRequest(req.request_id, req.prompt_ids.tolist(), sampling, adapter=req.adapter or None)


@dataclass
class Tracked:
    """What the worker keeps of a request the engine holds (tokens go back through the scheduler, which
    knows each request's gateway)."""

    prompt_tokens: int


class WorkerService:
    """One engine, its store client and its scheduler socket. `run()` is the busy loop."""

    def __init__(self, config: WorkerConfig, engine, loader: ArenaAdapterLoader, ctx: zmq.Context,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.engine = engine
        self.loader = loader
        self.clock = clock
        self.scheduler = ctx.socket(zmq.DEALER)
        self.scheduler.setsockopt(zmq.LINGER, 0)
        # A fresh routing id per process: a restarted worker is a new peer to the scheduler's ROUTER, never
        # mistaken for (or refused as a duplicate of) the connection of the process it replaces.
        self.scheduler.setsockopt(zmq.IDENTITY, f"{config.worker_id}/{os.getpid()}".encode())
        self.scheduler.connect(config.scheduler_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.scheduler, zmq.POLLIN)
        self.poller.register(loader.store.sock, zmq.POLLIN)
        self.parent_pid = os.getppid()
        self.handlers: dict[type, Callable[[Message], None]] = {
            Assign: self.on_assign,
            WorkerAbort: self.on_abort,
            PrefetchHint: self.on_prefetch_hint,
        }
        self.requests: dict[str, Tracked] = {}
        self.finished_ids: list[str] = []
        self.pending_outputs: list[TokenOutput] = []
        self.unsent: list[RequestOutput] = []  # the last step's outputs, sent while the next step runs
        self.status_step = 0
        self.last_status = float("-inf")
        self.last_touch = float("-inf")
        self.stopping = False
        self.max_running = engine.config.max_running_requests
        # A round's worth of requests queued here beyond the batch (see Engine.admission_round).
        self.backlog = engine.admission_round if engine.admission_round > 1 else 0

    # ---- 1) drain ------------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        # Idle waits also wake for the store's answer to a prefetch, so it is copied without delay.
        if timeout_s > 0:
            self.poller.poll(int(timeout_s * 1000))
        for _ in range(MAX_DRAIN):
            try:
                frames = self.scheduler.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode(frames)
            except WireError as e:
                log.error("worker.bad_message", error=str(e))
                continue
            handler = self.handlers.get(type(msg))
            if handler is None:
                log.error("worker.unexpected_message", type=type(msg).__name__)
                continue
            handler(msg)

    def on_assign(self, msg: Assign) -> None:
        for req in msg.requests:
            if req.request_id in self.requests:
                # Assigned twice: the first copy is live and streaming; failing the id would end its stream.
                log.warning("worker.duplicate_assign", request_id=req.request_id)
                continue
            try:
                self.engine.add_request(engine_request(req))
            except ValueError as e:
                log.info("worker.request_refused", request_id=req.request_id, error=str(e))
                self.pending_outputs.append(TokenOutput(req.request_id, [], finished=True, finish_reason="error",
                                                        prompt_tokens=len(req.prompt_ids), error=str(e)))
                self.finished_ids.append(req.request_id)
                continue
            self.requests[req.request_id] = Tracked(len(req.prompt_ids))

    def on_abort(self, msg: WorkerAbort) -> None:
        for request_id in msg.request_ids:
            # The engine queues a finished "abort" output for the next step; unknown ids already finished.
            if self.engine.abort(request_id):
                log.info("worker.aborted", request_id=request_id)

    def on_prefetch_hint(self, msg: PrefetchHint) -> None:
        """Start acquiring hinted adapters from the store now; the loop keeps stepping meanwhile."""
        for adapter in msg.adapters:
            if adapter not in self.engine.adapters:
                self.loader.prefetch(adapter)

    def load_prefetched(self) -> None:
        """Copy prefetched adapters the store has handed out into the GPU pool while there is plenty of
        room, so the requests that follow find them resident; never evicts anything for a guess."""
        engine = self.engine
        alloc = engine.pool.adapter_allocator  # the KV allocator too, unless the pool is split (no-unify)
        for adapter in self.loader.collect():
            if adapter in engine.adapters:
                continue
            if len(engine.adapters.names) >= engine.config.max_resident_adapters:
                continue
            packed = self.loader.pinned[adapter]
            room = alloc.num_free - packed.n_slots
            if room < self.config.gpu_prefetch_free_fraction * alloc.num_slots:
                continue  # stays pinned in the arena until used or its grace period lapses
            try:
                if engine.adapters.acquire(adapter) is not None:
                    engine.adapters.release(adapter)  # resident and unused: first in line for eviction
                    log.debug("worker.prefetched", adapter=adapter)
            except (KeyError, ValueError) as e:
                log.info("worker.prefetch_failed", adapter=adapter, error=str(e))

    # ---- 2) step -------------------------------------------------------------------------------
    def finish_step(self, flight) -> list[RequestOutput]:
        outputs = self.engine.finish_step(flight)
        self.loader.release_evicted(self.held_adapters())
        return outputs

    def held_adapters(self) -> set[str]:
        """Adapters whose arena bytes the engine may still read: staged for a waiting request, or being
        copied into its pool. Every other pin is given back (resident copies need no host bytes)."""
        return self.engine.adapters.held_names

    # ---- 3) emit -------------------------------------------------------------------------------
    def emit(self, outputs: list[RequestOutput]) -> None:
        batch = self.pending_outputs
        self.pending_outputs = []
        for out in outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None:
                continue
            batch.append(TokenOutput(out.request_id, out.new_token_ids, finished=out.finished,
                                     finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                                     completion_tokens=out.completion_tokens, error=out.error))
            if out.finished:
                del self.requests[out.request_id]
                self.finished_ids.append(out.request_id)
        if batch:
            self._send(TokenBatch(self.config.worker_id, batch))

    def report(self, force: bool) -> None:
        now = self.clock()
        if not force and now - self.last_status < self.config.heartbeat_s:
            return
        cap = self.engine.capacity()
        self.status_step += 1
        status = WorkerStatus(
            worker_id=self.config.worker_id, step=self.status_step, total_slots=cap["total_slots"],
            free_slots=cap["free_slots"], evictable_slots=cap["evictable_slots"], kv_slots=cap["kv_slots"],
            adapter_slots=cap["adapter_slots"],
            running=cap["running"], waiting=cap["waiting"], resident_adapters=list(cap["resident_adapters"]),
            finished_request_ids=self.finished_ids, ready=not self.stopping, max_running=self.max_running,
            backlog=self.backlog,
            adapter_loads=cap["adapter_loads"], adapter_load_bytes=cap["adapter_bytes_loaded"],
            preemptions=cap.get("preemptions", 0), recomputed_tokens=cap.get("recomputed_tokens", 0),
            decode_reserve_share=cap.get("decode_reserve_share", 0.0),
        )
        stats = cap.get("step_stats")
        if stats is not None:
            status.step_counts, status.step_seconds, status.step_tokens = (dict(stats.steps), dict(stats.seconds),
                                                                          dict(stats.tokens))
            status.step_launch_seconds, status.step_ahead_counts = dict(stats.launch), dict(stats.ahead)
            status.step_adapters, status.step_adapter_bytes = dict(stats.adapters), dict(stats.adapter_bytes)
            status.step_decode_keys, status.step_prompt_pairs = dict(stats.decode_keys), dict(stats.prompt_pairs)
            status.step_sampled = dict(stats.sampled)
            status.step_captures, status.step_capture_seconds = dict(stats.captures), dict(stats.capture_seconds)
            status.step_builds, status.step_build_seconds = dict(stats.builds), dict(stats.build_seconds)
            status.step_gpu_seconds, status.step_gpu_counts = dict(stats.gpu_seconds), dict(stats.gpu_steps)
        status.steps_held_back = dict(cap.get("held_back", {}))
        self._send(status)
        self.finished_ids = []
        self.last_status = now
        if now - self.last_touch >= self.config.heartbeat_s:
            self.last_touch = now
            if self.config.ready_file:
                os.utime(self.config.ready_file)
            if os.getppid() != self.parent_pid:
                # Children die with their parent: reparented means the supervisor is gone (even SIGKILLed).
                log.warning("worker.parent_gone", worker=self.config.worker_id)
                self.stopping = True

    def _send(self, msg: Message) -> None:
        try:
            self.scheduler.send_multipart(encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # Scheduler gone or far behind: its next incarnation learns the state from the next status.
            log.warning("worker.send_dropped", type=type(msg).__name__)

    # ---- loop ----------------------------------------------------------------------------------
    def run_once(self) -> None:
        """Launch a step, then do this loop's host work (send the last step's tokens and the status, take in
        new messages) while the GPU runs it, then collect its tokens."""
        started = self.clock()
        self.load_prefetched()
        flight = self.engine.launch_step() if self.engine.has_unfinished() else None
        self.emit(self.unsent)
        self.unsent = []
        self.report(force=bool(self.finished_ids) or self.engine.has_unfinished())
        if flight is None:
            self.loader.release_evicted(self.held_adapters())
        # Nothing on the GPU: wait for messages, but only briefly while adapters are on their way from
        # the store (their replies arrive on another socket, and waiting requests need them).
        idle_wait = ADAPTER_POLL_S if self.loader.pending else self.config.heartbeat_s / 2
        self.drain(0.0 if flight is not None or self.pending_outputs else idle_wait)
        if flight is not None:
            self.unsent = self.finish_step(flight)
            took = self.clock() - started
            if took > 4 * self.config.heartbeat_s:
                # The scheduler declares a worker dead after a few silent heartbeats: say why we were silent.
                log.warning("worker.slow_step", seconds=round(took, 3), running=len(self.engine.running),
                            waiting=len(self.engine.waiting))

    def run(self) -> None:
        if self.config.ready_file:
            write_ready_file(self.config.ready_file)
        self.report(force=True)
        log.info("worker.ready", worker=self.config.worker_id, pid=os.getpid())
        try:
            while not self.stopping:
                self.run_once()
        except Exception as e:
            log.exception("worker.engine_failed", worker=self.config.worker_id)
            self.fail_all(f"worker {self.config.worker_id} failed: {type(e).__name__}: {e}")
            raise
        self.fail_all(f"worker {self.config.worker_id} stopped")

    def fail_all(self, message: str) -> None:
        """One terminal error for every request this worker still holds (the engine is gone or stopping)."""
        self.emit(self.unsent)
        self.unsent = []
        batch = self.pending_outputs + [
            TokenOutput(rid, [], finished=True, finish_reason="error", prompt_tokens=t.prompt_tokens, error=message)
            for rid, t in self.requests.items()
        ]
        self.pending_outputs = []
        self.finished_ids.extend(self.requests)
        self.requests.clear()
        if batch:
            self._send(TokenBatch(self.config.worker_id, batch))
        self.stopping = True
        self.report(force=True)

    def stop(self, *_):
        self.stopping = True

    def close(self) -> None:
        self.loader.release_all()
        self.scheduler.close(0)


def write_ready_file(path: str) -> None:
    """Our pid in `path`, written atomically: the supervisor's ready signal. Its mtime, refreshed every
    heartbeat, is the alive signal (a hung or stopped worker stops refreshing it)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, p)


def install_signal_handlers(service: WorkerService) -> None:
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
