"""Typed configuration of the scheduler process; field docs become `--help`, unknown keys are rejected."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import config_from_args, from_dict
from shared.config import doc_field as _doc


QUEUE_ORDERS = ("auto", "deadline", "fcfs", "lcfs")


@dataclass
class SchedulerConfig:
    """Settings of the scheduler: queueing, admission, clustering, routing and worker supervision."""

    gateway_bind: str = _doc("ZeroMQ address of the ROUTER socket gateways connect to", "tcp://127.0.0.1:5570")
    worker_bind: str = _doc("ZeroMQ address of the ROUTER socket workers connect to", "tcp://127.0.0.1:5571")
    store_addr: str = _doc("ZeroMQ address of the adapter_store, told which adapters to warm; empty = none", "")
    max_queue: int = _doc("requests waiting at most; more -> 429 with Retry-After", 1024)
    max_queue_per_tenant: int = _doc("requests one tenant may have waiting; more -> 429 for that tenant; 0 = no bound", 0)
    first_token_slo_s: float = _doc("first-token SLO: queued requests that cannot meet it are aborted early; 0 = off", 6.0)
    prefill_overhead_s: float = _doc("initial estimate of the fixed cost of a prefill, seconds", 0.02)
    prefill_per_token_s: float = _doc("initial estimate of prefill seconds per prompt token (learned as it runs)", 1e-4)
    queue_order: str = _doc("service order of the queue: auto (FCFS, newest first while arrivals outpace admissions, as "
                            "S-LoRA), deadline (as auto, but FCFS while the queue still drains within the first-token "
                            "SLO), fcfs or lcfs (fixed, for comparing admission policies)", "auto")
    rate_period_s: float = _doc("scheduling period over which arrivals and admissions are averaged, seconds", 0.5)
    rate_smoothing: float = _doc("weight of the latest period in the arrival/admission moving averages", 0.3)
    cluster_adapters: int = _doc("adapter clustering d: past d distinct adapters in a batch, prefer requests of its adapters; 0 = off", 8)
    max_adapters_per_batch: int = _doc("distinct adapters in one worker's batch at most; 0 = no bound", 0)
    lookahead: int = _doc("queued requests considered per scheduling decision", 256)
    prefetch_adapters: int = _doc("adapters named in prefetch hints from the head of the queue, at most", 8)
    worker_max_running: int = _doc("requests a worker runs at once when its status does not say", 256)
    heartbeat_timeout_s: float = _doc("a worker silent this long is treated as dead (a killed worker is noticed at once "
                                      "from its closed connection; this catches hung ones)", 30.0)
    max_retries: int = _doc("times a request lost with a dead worker before streaming anything is requeued", 1)
    drain_timeout_s: float = _doc("on SIGTERM, time given to queued and running requests to finish", 30.0)
    log_level: str = _doc("log level: debug, info, warning, error", "info")
    log_json: bool = _doc("log one JSON object per line", False)

    def __post_init__(self) -> None:
        for name in ("max_queue", "lookahead", "worker_max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_queue_per_tenant", "first_token_slo_s", "cluster_adapters", "max_adapters_per_batch",
                     "prefetch_adapters", "max_retries", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_order not in QUEUE_ORDERS:
            raise ValueError(f"queue_order must be {', '.join(QUEUE_ORDERS[:-1])} or {QUEUE_ORDERS[-1]}, "
                             f"got {self.queue_order!r}")
        if self.queue_order == "deadline" and self.first_token_slo_s <= 0:
            raise ValueError("queue_order=deadline keeps oldest first while the queue drains within "
                             "first_token_slo_s: set first_token_slo_s > 0")
        if self.heartbeat_timeout_s <= 0 or self.rate_period_s <= 0:
            raise ValueError("heartbeat_timeout_s and rate_period_s must be positive")

    @classmethod
    def from_dict(cls, values: dict) -> "SchedulerConfig":
        return from_dict(cls, values)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "SchedulerConfig":
        return config_from_args(cls, argv, "python -m services.scheduler")
