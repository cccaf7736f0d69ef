"""GET /v1/status: one JSON picture of the running server for the dashboard and `loraplex status`.

Everything in it is read from what the gateway already holds: the Prometheus objects of /metrics (so the
totals here equal the ones a scraper sees), the scheduler's latest WorkerStatus round (workers, pool
slots, GPU-resident adapters), the store's Pong (the host arena) and its adapter listing (host and disk
tiers). Rates and latency summaries need history: a sampler takes one sample a second and keeps five
minutes of them, so a single call (a terminal command, a page just opened) already sees rates, and the
page draws its charts from the same points (`series`) instead of waiting to collect its own.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.gateway.auth import require_admin
from services.gateway.errors import ApiError, bad_request
from services.gateway.state import GatewayState

SAMPLE_PERIOD_S = 1.0
HISTORY_POINTS = 300  # five minutes of one-second samples
RATE_SPAN = 5  # samples a series point's rates and latencies are averaged over (smooths 1 s jitter)
THROUGHPUT_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0
QUANTILES = (0.5, 0.9, 0.99)
ADAPTER_ROWS = 100  # adapters listed per tier, most requested first (the counts are always complete)
HISTOGRAMS = ("ttft", "per_token", "e2e")


@dataclass
class Histogram:
    """One prometheus histogram read at one moment: cumulative bucket counts, sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float
    count: float

    def minus(self, older: Histogram | None) -> Histogram:
        if older is None:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.cumulative, older.cumulative)),
                         self.total - older.total, self.count - older.count)

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank q (Prometheus' histogram_quantile)."""
        if self.count <= 0:
            return None
        rank = q * self.cumulative[-1]
        low, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.cumulative):
            if count >= rank and count > below:
                if math.isinf(bound):
                    return low  # above the last finite bucket: its bound is all a histogram can say
                return low + (bound - low) * (rank - below) / (count - below)
            low, below = bound, count
        return low

    def summary(self) -> dict:
        out = {"count": int(self.count), "mean_s": self.total / self.count if self.count > 0 else None}
        for q in QUANTILES:
            out[f"p{round(q * 100)}_s"] = self.quantile(q)
        return out


def read_histogram(metric) -> Histogram:
    bounds, cumulative, total, count = [], [], 0.0, 0.0
    for sample in metric.collect()[0].samples:
        if sample.name.endswith("_bucket"):
            bounds.append(float(sample.labels["le"]))
            cumulative.append(sample.value)
        elif sample.name.endswith("_sum"):
            total = sample.value
        elif sample.name.endswith("_count"):
            count = sample.value
    return Histogram(tuple(bounds), tuple(cumulative), total, count)


def by_label(metric, label: str) -> dict[str, int]:
    """A counter's totals per value of one label (summed over its other labels)."""
    out: dict[str, int] = {}
    for sample in metric.collect()[0].samples:
        if sample.name.endswith("_total"):
            key = sample.labels[label]
            out[key] = out.get(key, 0) + int(sample.value)
    return out


def counter_value(metric) -> int:
    return int(sum(s.value for s in metric.collect()[0].samples if s.name.endswith("_total")))


@dataclass
class Sample:
    """Counters and gauges at one moment, and the chart point derived from them and earlier samples."""

    t: float  # wall clock (the page's time axis)
    mono: float
    requests: int
    tokens: int
    prompt_tokens: int
    histograms: dict[str, Histogram]
    point: dict | None = None


def take_sample(state: GatewayState) -> Sample:
    m = state.metrics
    return Sample(time.time(), time.monotonic(), counter_value(m.requests), counter_value(m.generation_tokens),
                  counter_value(m.prompt_tokens), {name: read_histogram(getattr(m, name)) for name in HISTOGRAMS})


def _rate(newer: Sample, older: Sample | None, field: str) -> float | None:
    if older is None or newer.mono <= older.mono:
        return None
    return (getattr(newer, field) - getattr(older, field)) / (newer.mono - older.mono)


def _mean(newer: Sample, older: Sample | None, name: str) -> float | None:
    window = newer.histograms[name].minus(older.histograms[name] if older else None)
    return window.total / window.count if window.count > 0 else None


class StatusSampler:
    """One sample a second in the gateway's event loop (reading in-process objects only: microseconds)."""

    def __init__(self, state: GatewayState):
        self.state = state
        self.samples: deque[Sample] = deque(maxlen=HISTORY_POINTS + RATE_SPAN)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="status-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_PERIOD_S)

    def sample(self) -> Sample:
        sample = take_sample(self.state)
        older = self.samples[-RATE_SPAN] if len(self.samples) >= RATE_SPAN else (self.samples[0] if self.samples else None)
        sample.point = self._point(sample, older)
        self.samples.append(sample)
        return sample

    def _point(self, sample: Sample, older: Sample | None) -> dict:
        view = self.state.scheduler.view
        pong = view.pong
        pool = {wid: {"kv": s.kv_slots, "adapter": s.adapter_slots, "free": s.free_slots, "total": s.total_slots}
                for wid, s in sorted(view.workers.items())}
        return {
            "t": round(sample.t, 3),
            "requests_per_s": _rate(sample, older, "requests"),
            "tokens_per_s": _rate(sample, older, "tokens"),
            "ttft_s": _mean(sample, older, "ttft"),
            "per_token_s": _mean(sample, older, "per_token"),
            "queue_depth": pong.queue_depth if pong else 0,
            "running": sum(s.running for s in view.workers.values()),
            "in_flight": self.state.inflight,
            "pool": pool,
        }

    def baseline(self, now_mono: float, window_s: float) -> Sample | None:
        """The newest sample at least window_s old; None while the gateway is younger than that (its
        counters started at zero, so figures are then since start)."""
        best = None
        for sample in self.samples:
            if now_mono - sample.mono >= window_s:
                best = sample
            else:
                break
        return best

    def series(self, points: int) -> list[dict]:
        if points <= 0:
            return []
        return [s.point for s in list(self.samples)[-points:] if s.point is not None]


def _window_rate(now: Sample, base: Sample | None, field: str, started: float) -> float:
    elapsed = now.mono - (base.mono if base else started)
    value = getattr(now, field) - (getattr(base, field) if base else 0)
    return value / elapsed if elapsed > 0 else 0.0


def _adapter_rows(state: GatewayState) -> dict:
    """Adapters by where they are held now (GPU pool, else host arena, else disk only), with request counts."""
    view = state.scheduler.view
    on_workers: dict[str, list[str]] = {}
    for wid, status in sorted(view.workers.items()):
        for aid in status.resident_adapters:
            on_workers.setdefault(aid, []).append(wid)
    submitted = state.scheduler.submitted
    active = Counter(state.scheduler.adapter_of.values())
    gpu = set(on_workers)
    tiers: dict[str, list[dict]] = {"gpu": [], "host": [], "disk": []}
    for card in state.ready_cards:
        tier = state.residency(card, gpu)
        tiers[tier].append({"id": card.id, "name": card.name, "tenant": card.tenant, "rank": card.rank,
                            "bytes": card.bytes, "workers": on_workers.get(card.id, []),
                            "requests": submitted.get(card.id, 0), "active": active.get(card.id, 0)})
    listed = {}
    for tier, rows in tiers.items():
        rows.sort(key=lambda r: (-r["requests"], r["tenant"], r["name"]))
        listed[tier] = {"count": len(rows), "adapters": rows[:ADAPTER_ROWS]}
    # Counted as /metrics counts them (loraplex_adapters_resident), from the same picture as the lists above.
    counts = {"gpu": listed["gpu"]["count"], "host": sum(c.host_resident for c in state.ready_cards),
              "disk": len(state.ready_cards)}
    return {"registered": len(state.ready_cards), "tiers": counts, "by_residency": listed,
            "base_model_requests": submitted.get("", 0), "base_model_active": active.get("", 0)}


def _workers(state: GatewayState) -> list[dict]:
    view = state.scheduler.view
    fresh = view.fresh(state.config.peer_timeout_s)
    out = []
    for wid, s in sorted(view.workers.items()):
        out.append({"id": wid, "healthy": fresh and s.ready, "ready": s.ready, "running": s.running,
                    "waiting": s.waiting, "max_running": s.max_running,
                    "slots": {"total": s.total_slots, "kv": s.kv_slots, "adapter": s.adapter_slots, "free": s.free_slots},
                    "resident_adapters": len(s.resident_adapters), "adapter_loads": s.adapter_loads,
                    "adapter_load_bytes": s.adapter_load_bytes, "preemptions": s.preemptions,
                    "recomputed_tokens": s.recomputed_tokens, "decode_reserve_share": s.decode_reserve_share,
                    # Since the worker started, by kind (graph-replayed decode, eager decode, prefill).
                    "steps": {kind: {"steps": n, "seconds": round(s.step_seconds.get(kind, 0.0), 3),
                                     "launch_seconds": round(s.step_launch_seconds.get(kind, 0.0), 3),
                                     "ahead": s.step_ahead_counts.get(kind, 0),
                                     "tokens": s.step_tokens.get(kind, 0),
                                     "adapters": s.step_adapters.get(kind, 0),
                                     "adapter_bytes": s.step_adapter_bytes.get(kind, 0)}
                              for kind, n in sorted(s.step_counts.items())},
                    # Steps not launched ahead of the last one's tokens, by why (Engine.held_back).
                    "steps_held_back": dict(sorted(s.steps_held_back.items()))})
    return out


def _arena(state: GatewayState) -> dict | None:
    pong = state.store.pong
    if pong is None:
        return None
    return {"capacity_bytes": pong.arena_capacity_bytes, "used_bytes": pong.arena_used_bytes,
            "pinned_bytes": pong.arena_pinned_bytes, "adapters": pong.arena_adapters, "pins": pong.arena_pins}


def build_status(state: GatewayState, sampler: StatusSampler, started: float, history: int) -> dict:
    now = take_sample(state)
    m = state.metrics
    checks = state.readiness()
    pong = state.scheduler.view.pong
    recent = sampler.baseline(now.mono, THROUGHPUT_WINDOW_S)
    minute = sampler.baseline(now.mono, LATENCY_WINDOW_S)
    latency = {"window_s": LATENCY_WINDOW_S}
    for name in HISTOGRAMS:
        hist = now.histograms[name]
        latency[name] = {**hist.minus(minute.histograms[name] if minute else None).summary(),
                         "total_count": int(hist.count), "total_sum_s": hist.total}
    return {
        "object": "status",
        "time": round(now.t, 3),
        "uptime_s": round(now.mono - started, 3),
        "model": {"name": state.base_name, "max_model_len": state.max_model_len},
        "auth": state.keys.enabled,
        "ready": all(checks.values()),
        "checks": checks,
        "scheduler": {"up": checks["scheduler"], "queue_depth": pong.queue_depth if pong else 0,
                      "workers_ready": pong.workers_ready if pong else 0},
        "adapter_store": {"up": checks["adapter_store"], "arena": _arena(state)},
        "workers": _workers(state),
        "requests": {"total": now.requests, "by_status": by_label(m.requests, "status"),
                     "in_flight": state.inflight, "prompt_tokens": now.prompt_tokens, "generation_tokens": now.tokens,
                     "rejections": by_label(m.rejections, "reason"), "aborts": by_label(m.aborts, "reason")},
        "throughput": {"window_s": THROUGHPUT_WINDOW_S,
                       "requests_per_s": _window_rate(now, recent, "requests", started),
                       "tokens_per_s": _window_rate(now, recent, "tokens", started),
                       "prompt_tokens_per_s": _window_rate(now, recent, "prompt_tokens", started)},
        "latency": latency,
        "adapters": _adapter_rows(state),
        "series": sampler.series(history),
    }


def _history_param(request: Request) -> int:
    raw = request.query_params.get("history", "0")
    if not raw.isascii() or not raw.isdigit() or int(raw) > HISTORY_POINTS:
        raise bad_request(f"history must be an integer from 0 to {HISTORY_POINTS} (seconds of chart points)",
                          "history")
    return int(raw)


async def status(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    try:
        require_admin(state.keys.caller(request.headers.get("authorization")))
        history = _history_param(request)
    except ApiError as e:
        return e.response()
    await state.refresh_tiers()
    sampler: StatusSampler = request.app.state.status_sampler
    return JSONResponse(build_status(state, sampler, request.app.state.started_at, history),
                        headers={"Cache-Control": "no-store"})


# ---- the document's schema (GET /openapi.json), next to the code that builds it ---------------------------

def status_schema() -> dict:
    def obj(props: dict, required: bool = True) -> dict:
        return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}

    count = {"type": "integer", "minimum": 0}
    seconds = {"type": ["number", "null"], "minimum": 0}
    rate = {"type": ["number", "null"]}
    per_label = {"type": "object", "additionalProperties": count}
    slots = obj({"total": count, "kv": count, "adapter": count, "free": count})
    window = obj({"count": count, "mean_s": seconds, "p50_s": seconds, "p90_s": seconds, "p99_s": seconds,
                  "total_count": count, "total_sum_s": {"type": "number", "minimum": 0}})
    adapter_row = obj({"id": {"type": "string"}, "name": {"type": "string"}, "tenant": {"type": "string"},
                       "rank": count, "bytes": count, "workers": {"type": "array", "items": {"type": "string"}},
                       "requests": count, "active": count})
    tier_rows = obj({"count": count, "adapters": {"type": "array", "items": adapter_row}})
    point = obj({"t": {"type": "number"}, "requests_per_s": rate, "tokens_per_s": rate, "ttft_s": seconds,
                 "per_token_s": seconds, "queue_depth": count, "running": count, "in_flight": count,
                 "pool": {"type": "object", "additionalProperties": slots}})
    return {
        **obj({
            "object": {"const": "status"},
            "time": {"type": "number", "description": "unix time of this answer"},
            "uptime_s": {"type": "number", "minimum": 0},
            "model": obj({"name": {"type": "string"}, "max_model_len": count}),
            "auth": {"type": "boolean"},
            "ready": {"type": "boolean"},
            "checks": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "scheduler": obj({"up": {"type": "boolean"}, "queue_depth": count, "workers_ready": count}),
            "adapter_store": obj({"up": {"type": "boolean"}, "arena": {"anyOf": [
                obj({"capacity_bytes": count, "used_bytes": count, "pinned_bytes": count, "adapters": count,
                     "pins": count}), {"type": "null"}]}}),
            "workers": {"type": "array", "items": obj({
                "id": {"type": "string"}, "healthy": {"type": "boolean"}, "ready": {"type": "boolean"},
                "running": count, "waiting": count, "max_running": count, "slots": slots,
                "resident_adapters": count, "adapter_loads": count, "adapter_load_bytes": count,
                "preemptions": count,
                "steps": {"type": "object", "additionalProperties": obj({
                    "steps": count, "seconds": {"type": "number", "minimum": 0}, "tokens": count})}})},
            "requests": obj({"total": count, "by_status": per_label, "in_flight": count, "prompt_tokens": count,
                             "generation_tokens": count, "rejections": per_label, "aborts": per_label}),
            "throughput": obj({"window_s": {"type": "number"}, "requests_per_s": {"type": "number", "minimum": 0},
                               "tokens_per_s": {"type": "number", "minimum": 0},
                               "prompt_tokens_per_s": {"type": "number", "minimum": 0}}),
            "latency": obj({"window_s": {"type": "number"}, "ttft": window, "per_token": window, "e2e": window}),
            "adapters": obj({
                "registered": count,
                "tiers": obj({"gpu": count, "host": count, "disk": count}),
                "by_residency": obj({"gpu": tier_rows, "host": tier_rows, "disk": tier_rows}),
                "base_model_requests": count, "base_model_active": count}),
            "series": {"type": "array", "items": point,
                       "description": "one point a second, oldest first (as many as the history parameter asked)"},
        }),
        "description": "Totals equal /metrics at the same moment; rates cover throughput.window_s seconds, latency "
                       "summaries latency.window_s (percentiles interpolated in the histogram buckets, as "
                       "Prometheus does). Tiers: adapters held in a GPU pool, in the host arena, on disk (every "
                       "registered adapter); by_residency lists each adapter once, where it is held closest to "
                       f"the GPU, at most {ADAPTER_ROWS} per tier, most requested first.",
    }
