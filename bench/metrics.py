"""The metrics of one run point (BENCHMARKS.md "Metrics"): `summarize` turns the client's request records
into throughput, latency and SLO figures; `ServerSampler` watches the server's /metrics during the run for
pool occupancy, adapter loads and queue peaks, where the workers' time went (steps by kind), and the GPU's
memory through nvidia-smi.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import httpx
import numpy as np

from bench.client import RequestRecord
from services.gpu_worker.step_stats import HELD_BACK_REASONS, STEP_KINDS
from shared.probes import metric_samples


def summarize(records: Sequence[RequestRecord], warmup_s: float, slo_s: float = 6.0,
              duration_s: float | None = None) -> dict:
    """The figures of one run, over its measured window.

    Window: the requests whose trace arrival is at or after `warmup_s` (earlier ones only warm the server
    up). It starts at `warmup_s` and ends at the later of the last finish of a completed window request
    and `duration_s` (the run's arrival span, when given), so window_s = end - warmup_s: a saturated
    server is timed until it has worked off the window's requests, and an idle one is not credited with a
    shorter time than the load took to offer.
    - throughput_rps = completed window requests / window_s; output_tok_s = their output tokens / window_s.
    - A request completed when its stream ended normally; every other window request (refused with 429,
      aborted early by the SLO policy, failed, timed out) counts in `aborted`, broken down in
      `errors_by_status` by the HTTP status of an error answer, or "timeout" (the client gave up after its
      request_timeout_s; also counted in `timed_out`), "stream" (a 200 stream that broke off) or "none" (no
      answer).
    - Latencies are from the request's trace arrival (so client lag, reported as send_lag_max_s, is never
      hidden) over completed window requests: latency = finish - arrival, TTFT = first token - arrival,
      TPOT = (finish - first token) / (output_tokens - 1) for requests of 2+ tokens. Percentiles are
      numpy.percentile's linear interpolation; figures over no request are None.
    - refused_after_min_s / refused_after_p50_s: time from arrival to an error answer (429 queue full, 503
      aborted early), over the window requests that got one (never a timeout or a begun stream): early
      abort should turn requests away near the SLO, and a refusal soon after arrival says its estimate of
      their prefill ran high.
    - slo_attainment: the fraction of all window requests that completed with TTFT <= slo_s (aborted ones
      miss). user_satisfaction: the mean over all window requests of 1 - (TTFT/slo_s)² when completed with
      TTFT < slo_s, else 0.
    """
    if warmup_s < 0:
        raise ValueError(f"warmup_s must be >= 0, got {warmup_s}")
    if not slo_s > 0:
        raise ValueError(f"slo_s must be > 0, got {slo_s}")
    window = [r for r in records if r.arrival_s >= warmup_s]
    done = [r for r in window if r.completed]
    end = max([r.finish_s for r in done] + [duration_s or 0.0, warmup_s])
    window_s = end - warmup_s
    ttft = np.array([r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None])
    latency = np.array([r.finish_s - r.arrival_s for r in done])
    tpot = np.array([(r.finish_s - r.first_token_s) / (r.output_tokens - 1)
                     for r in done if r.output_tokens > 1 and r.first_token_s is not None])
    met = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None
           and r.first_token_s - r.arrival_s <= slo_s]
    satisfaction = sum(1.0 - (t / slo_s) ** 2 for t in met if t < slo_s)
    errors: dict[str, int] = defaultdict(int)
    for r in window:
        if not r.completed:
            errors[_error_kind(r)] += 1
    refused = np.array([r.finish_s - r.arrival_s for r in window
                        if not r.completed and _error_answer(r) and r.finish_s is not None])
    lags = [r.sent_s - r.arrival_s for r in records if r.sent_s is not None]
    tokens = sum(r.output_tokens for r in done)
    return {
        "n_window": len(window),
        "n_completed": len(done),
        "aborted": len(window) - len(done),
        "errors_by_status": dict(sorted(errors.items())),
        "timed_out": errors.get("timeout", 0),
        "refused_after_min_s": float(refused.min()) if refused.size else None,
        "refused_after_p50_s": _pct(refused, 50),
        "window_s": window_s,
        "throughput_rps": len(done) / window_s if window_s > 0 else 0.0,
        "output_tok_s": tokens / window_s if window_s > 0 else 0.0,
        "output_tokens": tokens,
        "latency_mean_s": _mean(latency),
        "latency_p99_s": _pct(latency, 99),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": _mean(tpot),
        "tpot_p99_s": _pct(tpot, 99),
        "slo_s": slo_s,
        "slo_attainment": len(met) / len(window) if window else None,
        "user_satisfaction": satisfaction / len(window) if window else None,
        "send_lag_max_s": max(lags) if lags else None,
    }


def _error_answer(r) -> bool:
    """The server answered with an error status (a refusal). A stream that began (200) and then failed or
    outlasted the client was served, not refused; no status means no answer came."""
    return r.status not in (None, 200)


def _error_kind(r) -> str:
    """errors_by_status's key for a request that did not complete: the HTTP status of an error answer,
    "timeout" when the client gave up (whether or not the stream had begun), "stream" for a 200 stream
    that broke off, "none" when no answer came."""
    if _error_answer(r):
        return str(r.status)
    if r.error and r.error.startswith("timeout"):
        return "timeout"
    return "stream" if r.status == 200 else "none"


def _mean(a: np.ndarray) -> float | None:
    return float(a.mean()) if a.size else None


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if a.size else None


# ---------------------------------------------------------------------------------------------------------
# The server's side: /metrics sampled during the run.
# ---------------------------------------------------------------------------------------------------------
def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition: (name, sorted label pairs) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in metric_samples(text)}


def by_label(samples: dict, name: str, label: str, **match) -> dict[str, float]:
    """{value of `label`: sample value} for the samples of `name` whose other labels include `match`."""
    out = {}
    for (n, labels), value in samples.items():
        if n != name:
            continue
        d = dict(labels)
        if all(d.get(k) == v for k, v in match.items()) and label in d:
            out[d[label]] = value
    return out


# The workers' step counters (services/gpu_worker/step_stats.py), per kind of step.
STEP_COUNTERS = (("steps", "loraplex_worker_steps_total"), ("seconds", "loraplex_worker_step_seconds_total"),
                 ("tokens", "loraplex_worker_step_tokens_total"),
                 ("launch", "loraplex_worker_step_launch_seconds_total"),
                 ("ahead", "loraplex_worker_steps_ahead_total"),
                 ("adapters", "loraplex_worker_step_adapters_total"),
                 ("adapter_bytes", "loraplex_worker_step_adapter_bytes_total"),
                 ("decode_keys", "loraplex_worker_step_decode_keys_total"),
                 ("prompt_pairs", "loraplex_worker_step_prompt_pairs_total"),
                 ("sampled", "loraplex_worker_step_sampled_total"),
                 ("captures", "loraplex_worker_step_graph_captures_total"),
                 ("capture_seconds", "loraplex_worker_step_graph_capture_seconds_total"),
                 ("builds", "loraplex_worker_step_kernel_builds_total"),
                 ("build_seconds", "loraplex_worker_step_kernel_build_seconds_total"),
                 ("gpu_seconds", "loraplex_worker_step_gpu_seconds_total"),
                 ("gpu_steps", "loraplex_worker_steps_gpu_timed_total"))
# Of those, the totals a kind's floor needs (bench/step_floor.py), recorded as they are.
FLOOR_COUNTERS = ("adapter_bytes", "decode_keys", "prompt_pairs", "sampled")


class _CounterDelta:
    """Increase of a per-worker counter over the run; a value below the last one is a worker restart
    (its counter starts again from zero), so the new value is all increase."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.total = 0.0

    def update(self, per_worker: dict[str, float], baseline: bool) -> None:
        for worker, value in per_worker.items():
            prev = self.last.get(worker)
            if not baseline:
                self.total += value if prev is None or value < prev else value - prev
            self.last[worker] = value


def _smi_row(line: str) -> tuple[float, float, float | None]:
    """memory.used, memory.total (MiB) and utilization.gpu (%) of one GPU; utilization is None where the
    driver does not report it ("[N/A]", as under MIG)."""
    used, total, busy = (v.strip() for v in line.split(","))
    try:
        util = float(busy)
    except ValueError:
        util = None
    return float(used), float(total), util


class ServerSampler:
    """Polls GET {base_url}/metrics every `interval_s` in a thread from start() to stop(); `report()` gives
    the run's peaks (pool slots summed over workers, queue, running requests), the increase of the adapter
    load, load-byte, preemption and recomputed-token counters, the share of samples in which the scheduler served
    its queue newest first and the peak of its early-abort prefill estimate, and the peak GPU memory in use and the
    share of time the serving GPU ran a kernel (nvidia-smi, every `gpu_interval_s`; None where there is none).

    The baseline sample is taken in start() itself, so counters count from before the first request.
    Pool occupancy is the scheduler's view, refreshed by its worker pings, so a peak shorter than a ping
    round can be missed; the figures are peaks of what was observed."""

    def __init__(self, base_url: str, interval_s: float = 0.5, gpu_interval_s: float = 2.0,
                 api_key: str | None = None, nvidia_smi: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self.gpu_interval_s = gpu_interval_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.nvidia_smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.samples = 0
        self.newest_first_samples = 0  # samples in which the scheduler served its queue newest first
        self.sample_errors = 0
        self.last_error: str | None = None
        self.peaks: dict[str, float] = {}
        self.pool_total_slots: float | None = None
        self.counters = {k: _CounterDelta() for k in ("adapter_loads", "adapter_load_bytes", "preemptions",
                                                       "recomputed_tokens")}
        self.step_counters = {(field, kind): _CounterDelta() for field, _ in STEP_COUNTERS for kind in STEP_KINDS}
        # (monotonic time, every step counter's increase so far) after each sample: steps_within() takes the
        # increase over the measured window alone. Over the whole run, the ramp's and the drain's small
        # batches weigh in too (S2 at saturation averages ~331 rows a decode step over the run, with the steady
        # batch between a round's start at 352 and the cap of 384).
        self.step_history: list[tuple[float, dict]] = []
        self.held_back = {reason: _CounterDelta() for reason in HELD_BACK_REASONS}
        self.saw_steps = False  # servers without step counters (the PEFT baseline) report no worker_steps
        self.gpu_memory_used_peak_mib: float | None = None
        self.gpu_memory_total_mib: float | None = None
        # utilization.gpu of the GPU holding the most memory (the one serving), sampled during the run: the
        # share of time a kernel ran, so below 100% the GPU waited on the host (any kernel counts as busy).
        # (monotonic time, busy share) of each sample: busy_within() takes those of the measured window alone,
        # leaving out the warm-up's first seconds, when the GPU idles until requests arrive.
        self.gpu_busy: list[tuple[float, float]] = []
        self._last_gpu = 0.0

    def __enter__(self) -> ServerSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ServerSampler:
        self._client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=10.0)
        self._sample(baseline=True)
        self._thread = threading.Thread(target=self._loop, name="server-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop polling after one last sample; the report."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None
            self._sample(baseline=False, last=True)
            self._client.close()
        return self.report()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(baseline=False)

    def _sample(self, baseline: bool, last: bool = False) -> None:
        try:
            r = self._client.get("/metrics")
            r.raise_for_status()
            samples = parse_samples(r.text)
        except (httpx.HTTPError, ValueError) as e:
            with self._lock:
                self.sample_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:300]
        else:
            self._record(samples, baseline)
        now = time.monotonic()
        if self.nvidia_smi and (baseline or now - self._last_gpu >= self.gpu_interval_s):
            self._last_gpu = now
            # Busy shares only from samples in the point: not the baseline, taken before the first request, nor
            # stop()'s last one, taken once the GPU has drained.
            self._gpu_memory(busy=not (baseline or last))

    def _record(self, samples: dict, baseline: bool) -> None:
        slots = {kind: sum(by_label(samples, "loraplex_pool_slots", "worker", kind=kind).values())
                 for kind in ("kv", "adapter", "free", "total")}
        values = {
            "pool_kv_slots": slots["kv"],
            "pool_adapter_slots": slots["adapter"],
            "pool_used_slots": slots["kv"] + slots["adapter"],
            "queue_depth": samples.get(("loraplex_queue_depth", ()), 0.0),
            "running_requests": sum(by_label(samples, "loraplex_running_requests", "worker").values()),
            "worker_waiting_requests": sum(by_label(samples, "loraplex_worker_waiting_requests", "worker").values()),
            "gateway_in_flight": samples.get(("loraplex_gateway_in_flight", ()), 0.0),
            "adapters_resident_gpu": by_label(samples, "loraplex_adapters_resident", "tier").get("gpu", 0.0),
            "prefill_estimate_s": samples.get(("loraplex_scheduler_prefill_estimate_seconds", ()), 0.0),
        }
        with self._lock:
            self.samples += 1
            self.newest_first_samples += samples.get(("loraplex_scheduler_newest_first", ()), 0.0) > 0
            for k, v in values.items():
                self.peaks[k] = max(self.peaks.get(k, v), v)
            if slots["total"]:
                self.pool_total_slots = slots["total"]
                free = slots["free"]
                self.peaks["pool_free_slots_min"] = min(self.peaks.get("pool_free_slots_min", free), free)
            for key, name in (("adapter_loads", "loraplex_adapter_loads_total"),
                              ("adapter_load_bytes", "loraplex_adapter_load_bytes_total"),
                              ("preemptions", "loraplex_preemptions_total"),
                              ("recomputed_tokens", "loraplex_recomputed_tokens_total")):
                self.counters[key].update(by_label(samples, name, "worker"), baseline)
            for field, name in STEP_COUNTERS:
                for kind in STEP_KINDS:
                    per_worker = by_label(samples, name, "worker", kind=kind)
                    self.saw_steps |= bool(per_worker)
                    self.step_counters[field, kind].update(per_worker, baseline)
            self.step_history.append((time.monotonic(), {k: c.total for k, c in self.step_counters.items()}))
            for reason in HELD_BACK_REASONS:
                self.held_back[reason].update(
                    by_label(samples, "loraplex_worker_steps_held_back_total", "worker", reason=reason), baseline)

    def _gpu_memory(self, busy: bool) -> None:
        try:
            out = subprocess.run([self.nvidia_smi, "--query-gpu=memory.used,memory.total,utilization.gpu",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            rows = [_smi_row(line) for line in out.strip().splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError, ValueError):
            return
        if not rows:
            return
        used, _, util = max(rows, key=lambda r: r[0])  # the busiest GPU of the host
        with self._lock:
            self.gpu_memory_used_peak_mib = max(self.gpu_memory_used_peak_mib or 0.0, used)
            self.gpu_memory_total_mib = max(r[1] for r in rows)
            if util is not None and busy:
                self.gpu_busy.append((time.monotonic(), util / 100.0))

    def busy_within(self, start: float, end: float) -> dict:
        """The busy share over the samples read between two monotonic times (a point's measured window):
        its mean, its least sample and how many there were; None where no sample fell inside."""
        with self._lock:
            inside = [u for at, u in self.gpu_busy if start <= at <= end]
        return {"gpu_busy_window_mean": sum(inside) / len(inside) if inside else None,
                "gpu_busy_window_min": min(inside) if inside else None,
                "gpu_busy_window_samples": len(inside)}

    def steps_within(self, start: float, end: float) -> dict:
        """`worker_steps_window`: worker_steps over the samples between two monotonic times (a point's measured
        window), from the last sample at or before `start` to the last at or before `end`; None without two such
        samples or without step counters."""
        with self._lock:
            before = [totals for at, totals in self.step_history if at <= start]
            upto = [totals for at, totals in self.step_history if at <= end]
            if not self.saw_steps or not before or len(upto) <= len(before):
                return {"worker_steps_window": None}
            lo, hi = before[-1], upto[-1]
            return {"worker_steps_window": self._worker_steps({k: hi[k] - lo[k] for k in hi})}

    def report(self) -> dict:
        with self._lock:
            p = dict(self.peaks)
            total = self.pool_total_slots
            used = p.get("pool_used_slots")
            return {
                "pool_total_slots": _int(total),
                "pool_kv_slots_peak": _int(p.get("pool_kv_slots")),
                "pool_adapter_slots_peak": _int(p.get("pool_adapter_slots")),
                "pool_used_slots_peak": _int(used),
                "pool_free_slots_min": _int(p.get("pool_free_slots_min")),
                "pool_used_fraction_peak": used / total if total and used is not None else None,
                "queue_depth_peak": _int(p.get("queue_depth")),
                "running_requests_peak": _int(p.get("running_requests")),
                "worker_waiting_requests_peak": _int(p.get("worker_waiting_requests")),
                "gateway_in_flight_peak": _int(p.get("gateway_in_flight")),
                "adapters_resident_gpu_peak": _int(p.get("adapters_resident_gpu")),
                "newest_first_share": self.newest_first_samples / self.samples if self.samples else None,
                "prefill_estimate_peak_s": p.get("prefill_estimate_s"),
                **{key: _int(c.total) if self.samples else None for key, c in self.counters.items()},
                "worker_steps": self._worker_steps(),
                # Steps not launched ahead of the last one's tokens, by why (Engine.held_back); None from
                # servers without the counter.
                "worker_steps_held_back": ({reason: round(c.total) for reason, c in self.held_back.items()}
                                           if any(c.last for c in self.held_back.values()) else None),
                "gpu_memory_used_peak_mib": self.gpu_memory_used_peak_mib,
                "gpu_memory_total_mib": self.gpu_memory_total_mib,
                "gpu_busy_mean": sum(u for _, u in self.gpu_busy) / len(self.gpu_busy) if self.gpu_busy else None,
                "gpu_busy_min": min(u for _, u in self.gpu_busy) if self.gpu_busy else None,
                "gpu_busy_samples": len(self.gpu_busy),
                "metrics_samples": self.samples,
                "metrics_sample_errors": self.sample_errors,
            }

    def _worker_steps(self, totals: dict | None = None) -> dict | None:
        """Per kind of step over the run (or the counters' increases in `totals`, by (field, kind)), summed over
        workers: steps, seconds, tokens, the mean step in ms and the kind's share of all step seconds (None where
        no step counter was read)."""
        if not self.saw_steps:
            return None
        if totals is None:
            totals = {k: c.total for k, c in self.step_counters.items()}
        seconds = {kind: totals["seconds", kind] for kind in STEP_KINDS}
        busy = sum(seconds.values())
        out = {}
        for kind in STEP_KINDS:
            steps = round(totals["steps", kind])
            out[kind] = {"steps": steps, "seconds": round(seconds[kind], 4),
                         "tokens": round(totals["tokens", kind]),
                         "mean_ms": round(1e3 * seconds[kind] / steps, 3) if steps else None,
                         # The host's part of the mean step (None from servers before the launch counter).
                         "launch_ms": (round(1e3 * totals["launch", kind] / steps, 3)
                                       if steps and self.step_counters["launch", kind].last else None),
                         # Of the steps, those launched ahead of the last one's tokens (None: not reported).
                         "ahead": (round(totals["ahead", kind])
                                   if self.step_counters["ahead", kind].last else None),
                         # A mean step's distinct adapters read and the MB of their rows (None: not reported).
                         **self._adapters_per_step(kind, steps, totals),
                         # Totals for the kind's floor (None: not reported).
                         **{name: (round(totals[name, kind])
                                   if self.step_counters[name, kind].last else None) for name in FLOOR_COUNTERS},
                         # Graphs captured at first use inside the steps and the host's seconds in them (None:
                         # not reported): step time no floor accounts for.
                         "captures": (round(totals["captures", kind])
                                      if self.step_counters["captures", kind].last else None),
                         "capture_s": (round(totals["capture_seconds", kind], 3)
                                       if self.step_counters["capture_seconds", kind].last else None),
                         # Triton kernel variants built while the steps were issued, and the host's seconds
                         # in them (None: not reported): compiles under load, outside any floor.
                         "builds": (round(totals["builds", kind])
                                    if self.step_counters["builds", kind].last else None),
                         "build_s": (round(totals["build_seconds", kind], 3)
                                     if self.step_counters["build_seconds", kind].last else None),
                         # The GPU's own time of a mean timed step, first kernel to last (None: no step timed,
                         # as on the CPU); mean_ms less it is the stream's idle time between steps.
                         "gpu_ms": (round(1e3 * totals["gpu_seconds", kind] / totals["gpu_steps", kind], 3)
                                    if totals["gpu_steps", kind] else None),
                         "share": round(seconds[kind] / busy, 4) if busy else None}
        return out

    def _adapters_per_step(self, kind: str, steps: int, totals: dict) -> dict:
        # `last` is empty where no worker reported the counter (a server from before it); zero is a reading.
        reported = bool(self.step_counters["adapters", kind].last)
        count, nbytes = totals["adapters", kind], totals["adapter_bytes", kind]
        return {"adapters_mean": round(count / steps, 2) if steps and reported else None,
                "adapter_mb_mean": round(nbytes / steps / 1e6, 3) if steps and reported else None}


def _int(v: float | None) -> int | None:
    return None if v is None else round(v)
