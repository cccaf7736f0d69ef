"""Prometheus metrics of the gateway (/metrics).

Request counts, latencies and refusals are measured here, where requests begin and end. Queue depth,
running requests, pool slots and adapter residency are the scheduler's view of WorkerStatus, refreshed
by each ping round and read at scrape time by a collector, so the numbers are never stale copies
sitting in gauges nobody updates.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The *_created series double the exposition for nothing a dashboard uses.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class SchedulerCollector:
    """Reads the scheduler view (and the latest adapter listing) when Prometheus scrapes."""

    def __init__(self, scheduler_view, adapter_tiers, store_pong=lambda: None):
        self.view = scheduler_view
        self.adapter_tiers = adapter_tiers  # () -> {"gpu": n, "host": n, "disk": n} from the last listing
        self.store_pong = store_pong  # () -> the adapter_store's latest Pong (its arena figures), or None

    def collect(self):
        pong = self.view.pong
        yield _gauge("loraplex_queue_depth", "Requests waiting in the scheduler's queue", pong.queue_depth if pong else 0)
        yield _gauge("loraplex_workers_ready", "Workers alive and ready", pong.workers_ready if pong else 0)
        yield _gauge("loraplex_scheduler_newest_first", "1 while the scheduler serves its queue newest first "
                     "(its queue order's choice at its last scheduling decision), else 0",
                     int(pong.newest_first) if pong else 0)
        yield _gauge("loraplex_scheduler_prefill_estimate_seconds", "The scheduler's estimate of assignment to "
                     "first token for the longest prompt seen; early abort refuses what cannot meet the SLO with it",
                     pong.prefill_estimate_s if pong else 0.0)
        running = GaugeMetricFamily("loraplex_running_requests", "Requests running on each worker", labels=["worker"])
        waiting = GaugeMetricFamily("loraplex_worker_waiting_requests", "Requests waiting inside each worker", labels=["worker"])
        slots = GaugeMetricFamily("loraplex_pool_slots", "Unified pool slots by use", labels=["worker", "kind"])
        loads = CounterMetricFamily("loraplex_adapter_loads", "Adapters copied into a GPU pool", labels=["worker"])
        load_bytes = CounterMetricFamily("loraplex_adapter_load_bytes", "Bytes of adapters copied into a GPU pool", labels=["worker"])
        preemptions = CounterMetricFamily("loraplex_preemptions", "Running requests preempted for KV space (recomputed later)", labels=["worker"])
        recomputed = CounterMetricFamily("loraplex_recomputed_tokens", "Tokens whose K/V preemptions freed, computed again once their requests were readmitted (prefill spent twice)", labels=["worker"])
        reserve = GaugeMetricFamily("loraplex_decode_reserve_share", "Share of running requests' remaining output tokens whose KV slots admission keeps free (decode_reserve; 0 = none)", labels=["worker"])
        steps = CounterMetricFamily("loraplex_worker_steps", "Engine steps by kind (graph, decode, prefill)", labels=["worker", "kind"])
        step_seconds = CounterMetricFamily("loraplex_worker_step_seconds", "Seconds of engine steps from their scheduling until their tokens reached the host, by kind", labels=["worker", "kind"])
        step_tokens = CounterMetricFamily("loraplex_worker_step_tokens", "Tokens computed by engine steps (prompt and decode), by kind", labels=["worker", "kind"])
        step_ahead = CounterMetricFamily("loraplex_worker_steps_ahead", "Engine steps launched before the last step's tokens reached the host (overlap_steps), by kind", labels=["worker", "kind"])
        held_back = CounterMetricFamily("loraplex_worker_steps_held_back", "Engine steps not launched ahead of the last step's tokens (overlap_steps), by why: prompt, batch, round, slots", labels=["worker", "reason"])
        step_adapters = CounterMetricFamily("loraplex_worker_step_adapters", "Distinct adapters whose rows engine steps' LoRA kernels read, summed over steps, by kind (over the step count: a mean step's)", labels=["worker", "kind"])
        step_adapter_bytes = CounterMetricFamily("loraplex_worker_step_adapter_bytes", "Bytes of adapter rows engine steps' LoRA kernels read, summed over steps, by kind", labels=["worker", "kind"])
        step_decode_keys = CounterMetricFamily("loraplex_worker_step_decode_keys", "Context tokens read by engine steps' one-token rows (their attention's K/V), summed over steps, by kind", labels=["worker", "kind"])
        step_prompt_pairs = CounterMetricFamily("loraplex_worker_step_prompt_pairs", "(query, key) pairs engine steps' prompt chunks attend (causal), summed over steps, by kind", labels=["worker", "kind"])
        step_sampled = CounterMetricFamily("loraplex_worker_step_sampled", "Rows whose logits engine steps computed, by kind", labels=["worker", "kind"])
        step_captures = CounterMetricFamily("loraplex_worker_step_graph_captures", "Decode graphs captured at first use inside engine steps (not at warm-up), by kind", labels=["worker", "kind"])
        step_capture_seconds = CounterMetricFamily("loraplex_worker_step_graph_capture_seconds", "Host seconds of decode graphs captured at first use inside engine steps, kernel compiles included, by kind", labels=["worker", "kind"])
        step_builds = CounterMetricFamily("loraplex_worker_step_kernel_builds", "Triton kernel variants built while engine steps were issued (warm-up's steps included: a window's rise is those built under load), by kind", labels=["worker", "kind"])
        step_build_seconds = CounterMetricFamily("loraplex_worker_step_kernel_build_seconds", "Host seconds of Triton kernel variants built while engine steps were issued, by kind", labels=["worker", "kind"])
        step_gpu_seconds = CounterMetricFamily("loraplex_worker_step_gpu_seconds", "GPU seconds from engine steps' first kernel to their last (CUDA timing events), summed over the steps timed, by kind", labels=["worker", "kind"])
        step_gpu_counts = CounterMetricFamily("loraplex_worker_steps_gpu_timed", "Engine steps timed on the GPU, by kind", labels=["worker", "kind"])
        step_launch = CounterMetricFamily("loraplex_worker_step_launch_seconds", "Seconds of engine steps from their scheduling until their last kernel was launched (the host's part), by kind", labels=["worker", "kind"])
        for worker_id, status in sorted(self.view.workers.items()):
            running.add_metric([worker_id], status.running)
            waiting.add_metric([worker_id], status.waiting)
            slots.add_metric([worker_id, "kv"], status.kv_slots)
            slots.add_metric([worker_id, "adapter"], status.adapter_slots)
            slots.add_metric([worker_id, "free"], status.free_slots)
            slots.add_metric([worker_id, "total"], status.total_slots)
            loads.add_metric([worker_id], status.adapter_loads)
            load_bytes.add_metric([worker_id], status.adapter_load_bytes)
            preemptions.add_metric([worker_id], status.preemptions)
            recomputed.add_metric([worker_id], status.recomputed_tokens)
            reserve.add_metric([worker_id], status.decode_reserve_share)
            for family, values in ((steps, status.step_counts), (step_seconds, status.step_seconds),
                                   (step_tokens, status.step_tokens), (step_launch, status.step_launch_seconds),
                                   (step_ahead, status.step_ahead_counts), (step_adapters, status.step_adapters),
                                   (step_adapter_bytes, status.step_adapter_bytes),
                                   (step_decode_keys, status.step_decode_keys),
                                   (step_prompt_pairs, status.step_prompt_pairs), (step_sampled, status.step_sampled),
                                   (step_captures, status.step_captures),
                                   (step_capture_seconds, status.step_capture_seconds),
                                   (step_builds, status.step_builds), (step_build_seconds, status.step_build_seconds),
                                   (step_gpu_seconds, status.step_gpu_seconds), (step_gpu_counts, status.step_gpu_counts)):
                for kind, value in sorted(values.items()):
                    family.add_metric([worker_id, kind], value)
            for reason, value in sorted(status.steps_held_back.items()):
                held_back.add_metric([worker_id, reason], value)
        yield from (running, waiting, slots, loads, load_bytes, preemptions, recomputed, reserve, steps, step_seconds, step_tokens,
                    step_launch, step_ahead, step_adapters, step_adapter_bytes, step_decode_keys, step_prompt_pairs,
                    step_sampled, step_captures, step_capture_seconds, step_builds, step_build_seconds,
                    step_gpu_seconds, step_gpu_counts, held_back)
        tiers = GaugeMetricFamily("loraplex_adapters_resident", "Adapters held per tier (gpu pool, host arena, disk)", labels=["tier"])
        for tier, n in self.adapter_tiers().items():
            tiers.add_metric([tier], n)
        yield tiers
        store = self.store_pong()
        if store is not None:
            arena = GaugeMetricFamily("loraplex_arena_bytes", "Host adapter arena bytes by use", labels=["kind"])
            arena.add_metric(["total"], store.arena_capacity_bytes)
            arena.add_metric(["used"], store.arena_used_bytes)
            arena.add_metric(["pinned"], store.arena_pinned_bytes)
            yield arena
            yield _gauge("loraplex_arena_adapters", "Adapters held in the host arena", store.arena_adapters)
            yield _gauge("loraplex_arena_pins", "Arena acquisitions by workers not yet released", store.arena_pins)
            yield _counter("loraplex_arena_loads", "Adapters laid into the host arena", store.arena_loads)
            yield _counter("loraplex_arena_evictions", "Adapters evicted from the host arena", store.arena_evictions)
            yield _counter("loraplex_adapter_blob_reads", "Adapters read from disk for workers and hints",
                           store.blob_reads)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class GatewayMetrics:
    def __init__(self, scheduler_view, adapter_tiers, store_pong=lambda: None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplex_requests", "Inference requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time from request to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("loraplex_time_per_output_token_seconds", "Time between output tokens after the first", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_e2e_request_latency_seconds", "Time from request to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated", registry=r)
        self.aborts = Counter("loraplex_aborts", "Requests aborted after they were queued, by reason", ["reason"], registry=r)
        self.rejections = Counter("loraplex_rejections", "Requests refused before running, by reason", ["reason"], registry=r)
        # Set to read the gateway's own count at scrape time: a request that never ends shows here for good.
        self.in_flight = Gauge("loraplex_gateway_in_flight", "Inference requests between validation and their last byte", registry=r)
        self.adapter_ops = Counter("loraplex_adapter_operations", "Adapter management calls by operation and HTTP status", ["op", "status"], registry=r)
        r.register(SchedulerCollector(scheduler_view, adapter_tiers, store_pong))

    def render(self) -> bytes:
        return generate_latest(self.registry)
