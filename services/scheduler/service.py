"""The scheduler process: global waiting queue, admission, routing and supervision of workers.

Sockets (all ZeroMQ):
- gateways: ROUTER, bound. In: SubmitRequest, AbortRequest, Ping. Out: TokenBatch (each gateway gets
  the outputs of its own requests), RequestRejected, WorkerStatus (forwarded on Ping, for /metrics), Pong.
- workers: ROUTER, bound. In: WorkerStatus (at least every heartbeat), TokenBatch. Out: Assign,
  WorkerAbort, PrefetchHint.
- store: DEALER to adapter_store (optional). Out: WarmAdapters, so the host arena fills ahead of use.

Tokens flow worker -> scheduler -> gateway: the scheduler must see every output to know which requests
finished (capacity) and which already streamed (a dead worker's others can be requeued invisibly).
A dead peer is noticed at once from the socket monitor (the kernel closes a killed process's
connections) and, for a hung one, by a silent heartbeat.
"""
from __future__ import annotations

import os
import signal
import time
from collections import Counter, defaultdict
from itertools import islice

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.scheduler.admission import Admission
from services.scheduler.config import SchedulerConfig
from services.scheduler.early_abort import PrefillEstimator, hopeless
from services.scheduler.ordering import service_order
from services.scheduler.prefetch import prefetch_plan
from services.scheduler.queue_drain import fcfs_keeps_deadlines
from services.scheduler.rates import RateMonitor
from services.scheduler.routing import plan
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue
from services.scheduler.workers import InFlight, WorkerState
from shared.log import configure_logging, get_logger
from shared.ports import exit_if_address_in_use
from shared.wire import (
    AbortRequest, Assign, Ping, Pong, PrefetchHint, RequestRejected, SubmitRequest, TokenBatch, TokenOutput,
    WarmAdapters, WireError, WorkerAbort, WorkerStatus, decode, encode, tokens,
)

TICK_S = 0.05  # periodic checks (early abort, heartbeats, draining) run at least this often
DRAIN_BATCH = 256  # messages taken from one socket before the others get a turn


class PeerSocket:
    """A bound ROUTER socket plus a monitor that maps a closed connection back to the peer's identity."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises instead of vanishing
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(address)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.fd_peer: dict[int, bytes] = {}

    def recv(self) -> tuple[bytes, list] | None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            # The connection a message came in on; its later DISCONNECTED event names the same fd.
            self.fd_peer[frames[0].get(zmq.SRCFD)] = frames[0].bytes
        except zmq.ZMQError:
            pass
        return frames[0].bytes, frames[1:]

    def disconnected(self) -> list[bytes]:
        gone = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            peer = self.fd_peer.pop(event["value"], None)
            if peer is not None:
                gone.append(peer)
        return gone

    def send(self, identity: bytes, msg) -> bool:
        try:
            self.sock.send_multipart([identity, *encode(msg)], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; its disconnect is handled on its own
            return False

    def close(self, linger_ms: int = 0) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger_ms)


class Scheduler:
    def __init__(self, config: SchedulerConfig, ctx: zmq.Context | None = None):
        self.config = config
        self.log = get_logger("scheduler")
        self.ctx = ctx or zmq.Context.instance()
        self.gateways = PeerSocket(self.ctx, config.gateway_bind)
        self.workers_sock = PeerSocket(self.ctx, config.worker_bind)
        self.store = None
        if config.store_addr:
            self.store = self.ctx.socket(zmq.DEALER)
            self.store.setsockopt(zmq.LINGER, 0)
            self.store.setsockopt(zmq.SNDHWM, 64)
            self.store.connect(config.store_addr)
        self.poller = zmq.Poller()
        for sock in (self.gateways.sock, self.gateways.monitor, self.workers_sock.sock, self.workers_sock.monitor):
            self.poller.register(sock, zmq.POLLIN)

        now = time.monotonic()
        self.queue = WaitingQueue()
        self.admission = Admission(config.max_queue, config.max_queue_per_tenant)
        self.rates = RateMonitor(config.rate_period_s, config.rate_smoothing, now)
        self.estimator = PrefillEstimator(config.prefill_overhead_s, config.prefill_per_token_s)
        self.workers: dict[str, WorkerState] = {}
        self.inflight: dict[str, InFlight] = {}
        self.in_service: Counter[str] = Counter()  # tenant -> requests on workers
        self.warmed: dict[str, None] = {}  # adapters recently sent to the store to warm, oldest first
        self.dirty = False
        self.newest_first = False  # the order of the last scheduling decision, reported in Pong
        self.next_hint = 0.0
        self.draining_since: float | None = None
        self._drain_logged = False
        self.stopped = False
        self.parent_pid = os.getppid()

        # The whole protocol of this process, one table per socket.
        self.gateway_handlers = {
            SubmitRequest: self.on_submit,
            AbortRequest: self.on_abort,
            Ping: self.on_gateway_ping,
        }
        self.worker_handlers = {
            WorkerStatus: self.on_worker_status,
            TokenBatch: self.on_token_batch,
            Ping: self.on_worker_ping,
        }

    # ------------------------------------------------------------------------------------------------
    # Busy loop

    def run(self) -> None:
        self.log.info("scheduler ready", gateway_bind=self.gateways.address, worker_bind=self.workers_sock.address)
        next_tick = 0.0
        while not self.stopped:
            # 1) drain inputs (a bounded batch per socket, so a flood never starves the step)
            self.poller.poll(TICK_S * 1000)
            self._drain(self.gateways, self.gateway_handlers)
            self._drain(self.workers_sock, self.worker_handlers)
            for identity in self.workers_sock.disconnected():
                self._worker_gone_by_identity(identity, "disconnected")
            for identity in self.gateways.disconnected():
                self._gateway_gone(identity)
            # 2) step: periodic checks, then assignments and hints (sends happen as decisions are made)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self._check_heartbeats(now)
                self._check_parent()
                self.dirty = True
            if self.dirty:
                self.dirty = False
                self._schedule(now)
            if self.draining_since is not None:
                self._drain_step(now)
        self.close()

    def _drain(self, peer: PeerSocket, handlers) -> None:
        for _ in range(DRAIN_BATCH):
            got = peer.recv()
            if got is None:
                return
            identity, frames = got
            try:
                msg = decode(frames)
            except WireError as e:
                self.log.warning("malformed message dropped", error=str(e))
                continue
            handler = handlers.get(type(msg))
            if handler is None:
                self.log.warning("unexpected message dropped", type=type(msg).__name__)
                continue
            try:
                handler(identity, msg)
            except Exception:  # a bug costs one message, never the process that holds every queued request
                self.log.exception("handler failed", type=type(msg).__name__)

    def _check_parent(self) -> None:
        # Children die with their parent: when the launcher is gone (even by SIGKILL) we are reparented.
        if os.getppid() != self.parent_pid:
            self.log.warning("parent process gone; stopping")
            self.stopped = True

    def stop(self) -> None:
        self.stopped = True

    def begin_drain(self) -> None:
        """The SIGTERM/SIGINT handler: a plain assignment only. A handler runs between two bytecodes of the
        loop, possibly inside a log write that holds the log's (non-reentrant) lock, so a log call here could
        wait on it forever; the loop logs the drain when it sees it."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    def _drain_step(self, now: float) -> None:
        if not self._drain_logged:
            self._drain_logged = True
            self.log.info("draining", queued=len(self.queue), running=len(self.inflight))
        if not self.queue and not self.inflight:
            self.log.info("drained")
            self.stopped = True
        elif now - self.draining_since > self.config.drain_timeout_s:
            for request in self.queue.all():
                self.queue.remove(request.request_id)
                self._reject(request.origin, request.request_id, 503, "shutting_down", "the server is shutting down")
            for flight in list(self.inflight.values()):
                self._fail(flight, "the server shut down before this request finished")
            self.log.warning("drain timeout; remaining requests failed")
            self.stopped = True

    def close(self) -> None:
        # The last outputs of a drain may still be queued for the gateways: give them a moment to leave.
        self.gateways.close(linger_ms=1000)
        self.workers_sock.close()
        if self.store is not None:
            self.store.close(0)

    # ------------------------------------------------------------------------------------------------
    # Gateway messages

    def on_submit(self, origin: bytes, msg: SubmitRequest) -> None:
        now = time.monotonic()
        rid = msg.request_id
        if rid in self.queue or rid in self.inflight:
            self._reject(origin, rid, 409, "duplicate_request_id", f"request id {rid!r} is already in progress")
            return
        if self.draining_since is not None:
            self._reject(origin, rid, 503, "shutting_down", "the server is shutting down", retry_after=5.0)
            return
        self.rates.record_arrival(now)
        rejection = self.admission.check(self.queue, msg.tenant, self.rates.service_rate(now))
        if rejection is not None:
            self.log.info("request rejected", request_id=rid, reason=rejection.reason, tenant=msg.tenant)
            self._reject(origin, rid, 429, rejection.reason, rejection.message, retry_after=float(rejection.retry_after_s))
            return
        prompt_tokens = len(msg.prompt_ids)
        self.estimator.note_prompt(prompt_tokens)
        self.queue.push(QueuedRequest(rid, msg.adapter or "", msg.tenant, prompt_tokens, msg.max_tokens, now,
                                      submit=msg, origin=origin))
        self.dirty = True

    def on_abort(self, origin: bytes, msg: AbortRequest) -> None:
        rid = msg.request_id
        queued = self.queue.get(rid)
        if queued is not None and queued.origin == origin:
            self.queue.remove(rid)
            self.log.info("queued request aborted", request_id=rid, reason=msg.reason)
            self.dirty = True
            return
        flight = self.inflight.get(rid)
        if flight is not None and flight.request.origin == origin and not flight.aborted:
            self._abort_on_worker(flight, msg.reason)

    def on_gateway_ping(self, origin: bytes, msg: Ping) -> None:
        # Worker statuses first, the Pong last: the gateway knows the picture is complete when the Pong comes.
        for worker in self.workers.values():
            if worker.status is not None:
                self.gateways.send(origin, worker.status)
        self.gateways.send(origin, self._pong(msg))

    def _pong(self, msg: Ping) -> Pong:
        return Pong(service="scheduler", ready=self.draining_since is None, pid=os.getpid(), call_id=msg.call_id,
                    workers_ready=sum(1 for w in self.workers.values() if w.ready), queue_depth=len(self.queue),
                    newest_first=self.newest_first,
                    prefill_estimate_s=self.estimator.longest_estimate())

    def _gateway_gone(self, origin: bytes) -> None:
        """A gateway went away: nobody can receive its requests' tokens, so stop them all."""
        queued = [r for r in self.queue.all() if r.origin == origin]
        for request in queued:
            self.queue.remove(request.request_id)
        flights = [f for f in self.inflight.values() if f.request.origin == origin and not f.aborted]
        for flight in flights:
            self._abort_on_worker(flight, "gateway_gone")
        if queued or flights:
            self.log.warning("gateway gone; its requests aborted", queued=len(queued), running=len(flights))
            self.dirty = True

    # ------------------------------------------------------------------------------------------------
    # Worker messages

    def on_worker_status(self, identity: bytes, msg: WorkerStatus) -> None:
        now = time.monotonic()
        worker = self.workers.get(msg.worker_id)
        if worker is not None and worker.identity != identity:
            # Same worker id from a new socket: the process was restarted and lost what the old one held.
            self._worker_gone(worker, "restarted")
            worker = None
        if worker is None:
            worker = self.workers[msg.worker_id] = WorkerState(msg.worker_id, identity, now)
            self.log.info("worker joined", worker=msg.worker_id, total_slots=msg.total_slots)
        was_ready = worker.ready
        worker.on_status(msg, now)
        if worker.ready != was_ready:
            self.log.info("worker ready" if worker.ready else "worker not ready", worker=msg.worker_id)
        for rid in msg.finished_request_ids:
            self._finish(rid, worker)
        self.dirty = True

    def on_token_batch(self, identity: bytes, msg: TokenBatch) -> None:
        now = time.monotonic()
        worker = self.workers.get(msg.worker_id)
        if worker is not None and worker.identity != identity:
            worker = None  # an older process of this worker id, already declared dead
        # Outputs of requests this scheduler never assigned to this socket: assigned by a scheduler process
        # that has since died (or requeued away from a worker declared dead). Nobody will receive them, so
        # the worker is told to drop them instead of computing them to the end.
        orphans = [out.request_id for out in msg.outputs
                   if not out.finished and (worker is None or out.request_id not in worker.requests)]
        if orphans:
            self.workers_sock.send(identity, WorkerAbort(request_ids=orphans))
            self.log.warning("orphaned requests aborted on worker", worker=msg.worker_id, count=len(orphans))
        if worker is None:
            return
        per_gateway: dict[bytes, list[TokenOutput]] = defaultdict(list)
        for out in msg.outputs:
            flight = worker.requests.get(out.request_id)
            if flight is None:
                continue
            if not flight.streamed and (len(out.token_ids) or out.finished):
                flight.streamed = True
                if len(out.token_ids):
                    self.estimator.observe(flight.request.prompt_tokens, now - flight.assigned_at)
            if not flight.aborted:
                per_gateway[flight.request.origin].append(out)
            if out.finished:
                self._finish(out.request_id, worker)
        for origin, outputs in per_gateway.items():
            self.gateways.send(origin, TokenBatch(worker_id=msg.worker_id, outputs=outputs))

    def on_worker_ping(self, identity: bytes, msg: Ping) -> None:
        self.workers_sock.send(identity, self._pong(msg))

    def _finish(self, rid: str, worker: WorkerState) -> None:
        flight = worker.remove(rid)
        if flight is None:
            return
        del self.inflight[rid]
        self.in_service[flight.request.tenant] -= 1
        if self.in_service[flight.request.tenant] <= 0:
            del self.in_service[flight.request.tenant]
        self.dirty = True

    def _abort_on_worker(self, flight: InFlight, reason: str) -> None:
        flight.aborted = True
        worker = self.workers.get(flight.worker_id)
        if worker is not None:
            self.workers_sock.send(worker.identity, WorkerAbort(request_ids=[flight.request.request_id]))
        self.log.info("running request aborted", request_id=flight.request.request_id, worker=flight.worker_id, reason=reason)

    # ------------------------------------------------------------------------------------------------
    # Worker failure

    def _check_heartbeats(self, now: float) -> None:
        for worker in list(self.workers.values()):
            if now - worker.last_seen > self.config.heartbeat_timeout_s:
                self._worker_gone(worker, "heartbeat timeout")

    def _worker_gone_by_identity(self, identity: bytes, reason: str) -> None:
        for worker in list(self.workers.values()):
            if worker.identity == identity:
                self._worker_gone(worker, reason)

    def _worker_gone(self, worker: WorkerState, reason: str) -> None:
        """Requeue what the worker held and had not streamed yet; end the others with an error."""
        self.workers.pop(worker.worker_id, None)
        if worker.requests:
            # A worker declared dead may only be slow: make it drop what is being requeued or failed here,
            # so it neither computes them for nobody nor finishes a requeued copy twice.
            self.workers_sock.send(worker.identity, WorkerAbort(request_ids=list(worker.requests)))
        requeued = failed = 0
        for rid in list(worker.requests):
            flight = worker.remove(rid)
            del self.inflight[rid]
            self.in_service[flight.request.tenant] -= 1
            if self.in_service[flight.request.tenant] <= 0:
                del self.in_service[flight.request.tenant]
            if flight.aborted:
                continue
            if not flight.streamed and flight.request.retries < self.config.max_retries:
                self.queue.push_retry(flight.request)
                requeued += 1
            else:
                self._fail(flight, f"worker {worker.worker_id} failed ({reason}) while running this request")
                failed += 1
        self.log.warning("worker gone", worker=worker.worker_id, reason=reason, requeued=requeued, failed=failed)
        self.dirty = True

    def _fail(self, flight: InFlight, message: str) -> None:
        """A clean terminal answer for a request that cannot complete."""
        request = flight.request
        if flight.streamed:
            out = TokenOutput(request_id=request.request_id, token_ids=tokens([]), finished=True,
                              finish_reason="error", error=message)
            self.gateways.send(request.origin, TokenBatch(worker_id=flight.worker_id, outputs=[out]))
        else:
            self._reject(request.origin, request.request_id, 503, "worker_failed", message, retry_after=1.0)

    # ------------------------------------------------------------------------------------------------
    # Scheduling

    def _schedule(self, now: float) -> None:
        cfg = self.config
        self.newest_first = self._newest_first(now)  # an attribute: Pong reports it
        views = [w.view(cfg.worker_max_running) for w in self.workers.values()]
        if self.queue and any(v.ready and v.free_requests > 0 for v in views):
            window = list(islice(service_order(self.queue, self.newest_first, self.in_service), cfg.lookahead))
            self._assign(plan(window, views, cfg.cluster_adapters, cfg.max_adapters_per_batch), now)
        # Early abort after assignment: whatever a worker could take now is served, whatever its age.
        for request in hopeless(self.queue, now, cfg.first_token_slo_s, self.estimator):
            self.queue.remove(request.request_id)
            self.log.info("request aborted early", request_id=request.request_id, waited_s=round(now - request.arrival, 3))
            self._reject(request.origin, request.request_id, 503, "slo_unreachable",
                         f"the request could not get its first token within {cfg.first_token_slo_s:g} s",
                         retry_after=float(self.admission.retry_after(len(self.queue), self.rates.service_rate(now))))
        # Hints steer copies that take milliseconds: re-planning them once per tick is soon enough, and keeps
        # a worker's per-step statuses from each costing a walk of the queue head.
        if now >= self.next_hint:
            self.next_hint = now + TICK_S
            self._hint(self.newest_first)

    def _newest_first(self, now: float) -> bool:
        """S-LoRA's switch: newest first while arrivals outpace admissions; `deadline` also waits until the
        queue can no longer drain in time oldest first; a fixed order only for comparing policies."""
        cfg = self.config
        if cfg.queue_order in ("fcfs", "lcfs"):
            return cfg.queue_order == "lcfs"
        overloaded = self.rates.overloaded(now)
        if not overloaded or cfg.queue_order == "auto":
            return overloaded
        return not fcfs_keeps_deadlines(self.queue, now, cfg.first_token_slo_s, self.rates.service_rate(now),
                                        self.estimator)

    def _assign(self, assignments: list[tuple[QueuedRequest, str]], now: float) -> None:
        by_worker: dict[str, list[QueuedRequest]] = defaultdict(list)
        for request, worker_id in assignments:
            self.queue.remove(request.request_id)
            by_worker[worker_id].append(request)
        for worker_id, requests in by_worker.items():
            worker = self.workers[worker_id]
            for request in requests:
                flight = InFlight(request, worker_id, now)
                worker.add(flight)
                self.inflight[request.request_id] = flight
                self.in_service[request.tenant] += 1
            self.workers_sock.send(worker.identity, Assign(requests=[r.submit for r in requests]))
            self.rates.record_admission(now, len(requests))

    def _hint(self, newest_first: bool) -> None:
        cfg = self.config
        if not cfg.prefetch_adapters:
            return
        if not self.queue and not any(w.hinted for w in self.workers.values()):
            return  # nothing waiting and nothing announced: no hint can change
        views = [w.view(cfg.worker_max_running) for w in self.workers.values()]
        head = islice(service_order(self.queue, newest_first, self.in_service), cfg.lookahead)
        hints = prefetch_plan(head, views, cfg.prefetch_adapters)
        fresh: list[str] = []
        for worker_id, adapters in hints.items():
            worker = self.workers[worker_id]
            if adapters != worker.hinted:
                worker.hinted = adapters
                self.workers_sock.send(worker.identity, PrefetchHint(adapters=adapters))
            fresh.extend(a for a in adapters if a not in self.warmed)
        if fresh and self.store is not None:
            try:
                self.store.send_multipart(encode(WarmAdapters(adapters=fresh)), zmq.NOBLOCK)
            except zmq.Again:
                return  # the store is not keeping up; the worker's own acquire will load them
            # Remember recent warm-ups only, so an adapter evicted from the arena can be warmed again later.
            self.warmed.update(dict.fromkeys(fresh))
            for old in list(self.warmed)[: max(0, len(self.warmed) - 4 * cfg.prefetch_adapters)]:
                del self.warmed[old]

    # ------------------------------------------------------------------------------------------------

    def _reject(self, origin: bytes, rid: str, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        self.gateways.send(origin, RequestRejected(request_id=rid, status=status, code=code, message=message,
                                                   retry_after=retry_after))


def main(argv: list[str] | None = None) -> None:
    config = SchedulerConfig.from_args(argv)
    configure_logging(json=config.log_json, level=config.log_level)
    with exit_if_address_in_use(get_logger("scheduler"), gateway_bind=config.gateway_bind,
                                worker_bind=config.worker_bind):
        scheduler = Scheduler(config)
    signal.signal(signal.SIGTERM, lambda *_: scheduler.begin_drain())
    signal.signal(signal.SIGINT, lambda *_: scheduler.begin_drain())
    scheduler.run()
