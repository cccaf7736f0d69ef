"""summarize() against figures worked out by hand from its definitions; ServerSampler against a real stack
(fresh adapters, so loads must happen), against nothing, and with a stand-in nvidia-smi (the GPU driver's
tool is outside the system)."""
from __future__ import annotations

import asyncio
import shutil
import stat
import time

import pytest

from bench.client import RequestRecord, run_trace
from bench.metrics import ServerSampler, _CounterDelta, parse_samples, summarize
from bench.workload import TraceRequest
from shared.ports import free_port
from shared.probes import metric, metric_samples, metric_sum
from shared.tiny_model import VOCAB_SIZE
from tests.e2e.conftest import upload


def rec(index, arrival, first=None, finish=None, tokens=0, error=None, status=200) -> RequestRecord:
    return RequestRecord(index, 0, 8, tokens, arrival, arrival, first, finish, tokens, error, status)


RECORDS = [
    rec(0, 0.5, 0.6, 0.7, 4),  # arrives during warm-up: not measured
    rec(1, 1.0, 2.0, 4.0, 5),  # ttft 1, latency 3, tpot (4-2)/4 = 0.5
    rec(2, 2.0, 5.0, 9.0, 3),  # ttft 3, latency 7, tpot 4/2 = 2
    rec(3, 3.0, 10.0, 11.0, 1),  # ttft 7 (misses the 6 s SLO), latency 8, no tpot (one token)
    rec(4, 4.0, None, 4.01, 0, "HTTP 429: queue is full", 429),
    rec(5, 5.0, None, 35.0, 0, "timeout: no complete answer within 30s", None),
]


def test_summarize_by_hand():
    s = summarize(RECORDS, warmup_s=1.0, slo_s=6.0, duration_s=8.0)
    assert (s["n_window"], s["n_completed"], s["aborted"]) == (5, 3, 2)
    assert s["errors_by_status"] == {"429": 1, "timeout": 1} and s["timed_out"] == 1
    # Refused 0.01 s after arriving; the timeout got no answer, so it is not a refusal.
    assert s["refused_after_min_s"] == pytest.approx(0.01) and s["refused_after_p50_s"] == pytest.approx(0.01)
    # Window [1, 11): the last completed window request finishes at 11 (later than the 8 s of arrivals;
    # the timed-out request's end does not stretch it).
    assert s["window_s"] == pytest.approx(10.0)
    assert s["throughput_rps"] == pytest.approx(3 / 10)
    assert s["output_tokens"] == 9 and s["output_tok_s"] == pytest.approx(9 / 10)
    assert s["latency_mean_s"] == pytest.approx((3 + 7 + 8) / 3)
    assert s["ttft_mean_s"] == pytest.approx(11 / 3)
    # Linear interpolation over sorted TTFTs [1, 3, 7]: p50 = 3, p90 at rank 1.8 = 3 + 0.8*4, p99 at 1.98.
    assert s["ttft_p50_s"] == pytest.approx(3.0)
    assert s["ttft_p90_s"] == pytest.approx(6.2)
    assert s["ttft_p99_s"] == pytest.approx(6.92)
    assert s["tpot_mean_s"] == pytest.approx((0.5 + 2.0) / 2)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # aborted requests count as misses
    assert s["user_satisfaction"] == pytest.approx(((1 - (1 / 6) ** 2) + (1 - (3 / 6) ** 2)) / 5)
    assert s["send_lag_max_s"] == 0.0


def test_requests_whose_stream_began_are_not_refusals():
    # LCFS under bursts: the server answers 200 at once, but the first token never comes before the client
    # gives up at 60 s; another stream breaks off after a token; one request gets no answer at all.
    records = [
        rec(0, 1.0, 1.5, 3.0, 4),
        rec(1, 2.0, None, 62.0, 0, "timeout: no complete answer within 60s", 200),
        rec(2, 3.0, 3.5, 4.0, 1, "the stream ended before [DONE]", 200),
        rec(3, 4.0, None, 4.5, 0, "ConnectError: refused", None),
        rec(4, 5.0, None, 9.5, 0, "HTTP 503: hopeless", 503),
    ]
    s = summarize(records, warmup_s=0.0)
    assert s["errors_by_status"] == {"503": 1, "none": 1, "stream": 1, "timeout": 1}
    assert s["timed_out"] == 1 and s["aborted"] == 4
    # Only the 503 was an error answer: refused 4.5 s after arriving, not 60.
    assert s["refused_after_min_s"] == pytest.approx(4.5) and s["refused_after_p50_s"] == pytest.approx(4.5)


def test_window_end_and_slo_edges():
    # Arrivals offered for 20 s: the window lasts at least that long even if the server finished at 11.
    assert summarize(RECORDS, 1.0, duration_s=20.0)["window_s"] == pytest.approx(19.0)
    assert summarize(RECORDS, 1.0)["window_s"] == pytest.approx(10.0)
    # A tighter SLO: TTFT 1 meets 2 s (satisfaction 1 - 1/4), TTFT 3 does not.
    s = summarize(RECORDS, 1.0, slo_s=2.0)
    assert s["slo_attainment"] == pytest.approx(1 / 5) and s["user_satisfaction"] == pytest.approx(0.75 / 5)
    # Exactly at the SLO: attained, but a satisfaction of 0.
    s = summarize([rec(0, 0.0, 6.0, 7.0, 2)], 0.0, slo_s=6.0)
    assert s["slo_attainment"] == 1.0 and s["user_satisfaction"] == 0.0
    # Warm-up excludes requests by arrival, not by finish.
    assert summarize(RECORDS, 2.0)["n_window"] == 4


def test_empty_window():
    s = summarize(RECORDS, warmup_s=100.0)
    assert (s["n_window"], s["throughput_rps"], s["aborted"]) == (0, 0.0, 0)
    assert s["ttft_p50_s"] is None and s["latency_mean_s"] is None and s["slo_attainment"] is None
    assert s["refused_after_min_s"] is None and s["refused_after_p50_s"] is None
    with pytest.raises(ValueError, match="warmup_s"):
        summarize(RECORDS, -1.0)
    with pytest.raises(ValueError, match="slo_s"):
        summarize(RECORDS, 0.0, slo_s=0)


def test_counter_delta_survives_worker_restarts():
    c = _CounterDelta()
    c.update({"worker-0": 10}, baseline=True)
    c.update({"worker-0": 15}, baseline=False)  # +5
    c.update({"worker-0": 3}, baseline=False)  # restarted: +3
    c.update({"worker-0": 4, "worker-1": 2}, baseline=False)  # +1, and a new worker's +2
    assert c.total == 11


def scrape(stack) -> str:
    return stack.metrics()


def step_tokens(text: str) -> float:
    return metric_sum(metric_samples(text), "loraplex_worker_step_tokens_total", worker="worker-0")


def settled(stack, timeout_s: float = 20.0) -> str:
    """/metrics once the stack runs nothing and its step counters have stopped moving for a ping round."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        text = scrape(stack)
        busy = (metric(text, "loraplex_running_requests", worker="worker-0") or 0) + \
            (metric(text, "loraplex_queue_depth") or 0)
        if not busy and last is not None and step_tokens(text) == step_tokens(last):
            return text
        last = text
        time.sleep(0.6)
    raise AssertionError("the shared stack did not go idle")


def test_sampler_on_a_live_stack(core_stack, tmp_path):
    from shared.make_adapters import make_adapters

    folders = make_adapters(tmp_path / "fresh", core_stack.data_dir / "model", 2, ranks=[8, 16], seed=21, prefix="sampled")
    with core_stack.client() as c:
        for f in folders:
            assert upload(c, f, f.name).status_code in (200, 201)
    names = [f.name for f in folders]
    # Outputs long enough, and samples close enough, that requests are seen in flight on a loaded machine.
    trace = [TraceRequest(i, 0.1 * i, i % 2, 24, 120) for i in range(12)]

    before = settled(core_stack)  # other tests' requests on this shared stack would count as ours
    sampler = ServerSampler(core_stack.url, interval_s=0.05).start()
    records = asyncio.run(run_trace(core_stack.url, trace, lambda r: names[r.adapter], VOCAB_SIZE, progress=False, processes=1))
    # The worker's last steps reach /metrics with the scheduler's next ping round: wait for the step counters
    # to count every token (each prompt prefilled once, each output token but the last fed back once).
    computed = sum(r.prompt_len + r.output_len - 1 for r in trace)
    deadline = time.monotonic() + 10
    while step_tokens(scrape(core_stack)) - step_tokens(before) < computed and time.monotonic() < deadline:
        time.sleep(0.05)
    report = sampler.stop()
    after = scrape(core_stack)

    assert all(r.completed for r in records)
    assert report["metrics_samples"] >= 5 and report["metrics_sample_errors"] == 0
    total = metric(after, "loraplex_pool_slots", worker="worker-0", kind="total")
    assert report["pool_total_slots"] == total
    assert 0 < report["pool_kv_slots_peak"] <= report["pool_used_slots_peak"] <= total
    assert report["pool_adapter_slots_peak"] > 0
    # Free and used are sampled together: the fewest free slots seen leave room for at most the peak use.
    assert total - report["pool_used_slots_peak"] <= report["pool_free_slots_min"] < total
    assert report["pool_used_fraction_peak"] == pytest.approx(report["pool_used_slots_peak"] / total)
    assert report["running_requests_peak"] >= 1
    # Both fresh adapters had to be copied into the pool; the figures are the server's own counters' rise.
    loads = metric(after, "loraplex_adapter_loads_total", worker="worker-0") - metric(before, "loraplex_adapter_loads_total", worker="worker-0")
    load_bytes = (metric(after, "loraplex_adapter_load_bytes_total", worker="worker-0")
                  - metric(before, "loraplex_adapter_load_bytes_total", worker="worker-0"))
    assert report["adapter_loads"] == loads >= 2
    assert report["adapter_load_bytes"] == load_bytes > 0
    # Where the worker's time went: the server's step counters' rise, per kind of step.
    steps = report["worker_steps"]
    for kind in ("graph", "decode", "prefill"):
        for field, name in (("steps", "loraplex_worker_steps_total"), ("tokens", "loraplex_worker_step_tokens_total"),
                            ("ahead", "loraplex_worker_steps_ahead_total"),
                            ("decode_keys", "loraplex_worker_step_decode_keys_total"),
                            ("prompt_pairs", "loraplex_worker_step_prompt_pairs_total"),
                            ("sampled", "loraplex_worker_step_sampled_total"),
                            ("captures", "loraplex_worker_step_graph_captures_total"),
                            ("builds", "loraplex_worker_step_kernel_builds_total"),
                            ("adapter_bytes", "loraplex_worker_step_adapter_bytes_total")):
            rise = metric(after, name, worker="worker-0", kind=kind) - metric(before, name, worker="worker-0", kind=kind)
            assert steps[kind][field] == rise, (kind, field)
        # A mean step's adapters read and the MB of their rows, from the server's counters' rise.
        if steps[kind]["steps"]:
            # Reported to 2 decimals (adapters) and 3 (MB): within half the last digit.
            for field, name, scale, half in (("adapters_mean", "loraplex_worker_step_adapters_total", 1, 5e-3),
                                             ("adapter_mb_mean", "loraplex_worker_step_adapter_bytes_total", 1e6, 5e-4)):
                rise = metric(after, name, worker="worker-0", kind=kind) - metric(before, name, worker="worker-0", kind=kind)
                assert steps[kind][field] == pytest.approx(rise / scale / steps[kind]["steps"], abs=half), (kind, field)
    # Every request names one of the two adapters: each step read one or both.
    assert 1 <= steps["decode"]["adapters_mean"] <= 2 and steps["decode"]["adapter_mb_mean"] > 0
    # Every prompt's tokens attend causally in prefill steps; decode steps' rows each read their context.
    assert steps["prefill"]["prompt_pairs"] == sum(r.prompt_len * (r.prompt_len + 1) // 2 for r in trace)
    assert steps["decode"]["decode_keys"] > steps["decode"]["tokens"] and steps["decode"]["prompt_pairs"] == 0
    assert steps["prefill"]["steps"] >= 1 and steps["decode"]["steps"] >= 1 and steps["graph"]["steps"] == 0
    # No graphs on the CPU, so none captured under load; reported all the same (a zero, not None).
    assert all(steps[kind]["captures"] == 0 and steps[kind]["capture_s"] == 0.0 for kind in steps)
    # Nor kernels built under load: the CPU's interpreter builds none; reported all the same.
    assert all(steps[kind]["builds"] == 0 and steps[kind]["build_s"] == 0.0 for kind in steps)
    # Nor GPU timing events: no step timed, no GPU time (None rather than a zero that would read as idle).
    assert all(steps[kind]["gpu_ms"] is None for kind in steps)
    # Steps not launched ahead, by why: the server's counters' rise, every reason reported.
    held_back = report["worker_steps_held_back"]
    assert set(held_back) == {"prompt", "batch", "round", "slots"}
    for reason, n in held_back.items():
        rise = (metric(after, "loraplex_worker_steps_held_back_total", worker="worker-0", reason=reason)
                - metric(before, "loraplex_worker_steps_held_back_total", worker="worker-0", reason=reason))
        assert n == rise, reason
    assert sum(s["tokens"] for s in steps.values()) == computed
    assert steps["decode"]["mean_ms"] == pytest.approx(1e3 * steps["decode"]["seconds"] / steps["decode"]["steps"], rel=1e-3)
    assert sum(s["share"] for s in steps.values()) == pytest.approx(1.0, abs=1e-3)
    # The host's part of each step: from the server's launch counter, within the step's whole time.
    launch = (metric(after, "loraplex_worker_step_launch_seconds_total", worker="worker-0", kind="prefill")
              - metric(before, "loraplex_worker_step_launch_seconds_total", worker="worker-0", kind="prefill"))
    # Reported to the microsecond: with steps launched ahead the launch left outside the step before is small.
    assert steps["prefill"]["launch_ms"] == pytest.approx(1e3 * launch / steps["prefill"]["steps"], rel=1e-3, abs=1e-3)
    assert 0 < steps["prefill"]["launch_ms"] <= steps["prefill"]["mean_ms"]
    if shutil.which("nvidia-smi") is None:
        assert report["gpu_memory_used_peak_mib"] is None and report["gpu_memory_total_mib"] is None


def test_sampler_without_a_server_reports_nothing_it_did_not_see():
    with ServerSampler(f"http://127.0.0.1:{free_port()}", interval_s=0.05, nvidia_smi="") as s:
        pass
    report = s.report()
    assert report["metrics_samples"] == 0 and report["metrics_sample_errors"] >= 2
    assert report["adapter_loads"] is None and report["pool_kv_slots_peak"] is None and report["pool_total_slots"] is None
    assert report["worker_steps"] is None and report["worker_steps_held_back"] is None
    assert report["newest_first_share"] is None and report["prefill_estimate_peak_s"] is None


def test_sampler_reads_the_schedulers_queue_order_and_prefill_estimate():
    """Samples as the gateway exposes them: the share of samples served newest first, the estimate's peak."""
    sampler = ServerSampler("http://127.0.0.1:1", nvidia_smi="")
    for newest_first, estimate in ((0, 0.4), (1, 2.5), (1, 1.0), (0, 0.3)):
        text = (f"loraplex_scheduler_newest_first {newest_first}\n"
                f"loraplex_scheduler_prefill_estimate_seconds {estimate}\n")
        sampler._record(parse_samples(text), baseline=False)
    report = sampler.report()
    assert report["newest_first_share"] == 0.5 and report["prefill_estimate_peak_s"] == 2.5


def test_the_steps_of_a_window_leave_out_the_ramp_and_the_drain():
    """steps_within() takes the step counters' rise between the samples at a window's ends: a point's ramp and
    drain, whose small batches make short steps of few rows, no longer weigh in its steps."""
    sampler = ServerSampler("http://127.0.0.1:1", nvidia_smi="")

    def record(steps: int, seconds: float, tokens: int, baseline: bool = False) -> float:
        text = (f'loraplex_worker_steps_total{{worker="worker-0",kind="graph"}} {steps}\n'
                f'loraplex_worker_step_seconds_total{{worker="worker-0",kind="graph"}} {seconds}\n'
                f'loraplex_worker_step_tokens_total{{worker="worker-0",kind="graph"}} {tokens}\n')
        sampler._record(parse_samples(text), baseline=baseline)
        return time.monotonic()

    record(0, 0.0, 0, baseline=True)
    record(100, 1.0, 10_000)  # the ramp: 100 rows a step, 10 ms each
    start = record(300, 8.0, 90_000)  # (the last sample before the window's start)
    record(500, 15.0, 170_000)
    end = record(700, 22.0, 250_000)  # the steady state: 400 rows a step, 35 ms each
    record(800, 23.0, 260_000)  # the drain
    whole = sampler.report()["worker_steps"]["graph"]
    assert whole["steps"] == 800 and whole["tokens"] == 260_000 and whole["mean_ms"] == pytest.approx(28.75)
    window = sampler.steps_within(start + 1e-6, end + 1e-6)["worker_steps_window"]["graph"]
    assert window["steps"] == 400 and window["tokens"] == 160_000 and window["mean_ms"] == pytest.approx(35.0)
    assert window["share"] == 1.0
    # No sample at or before the window's start, or none inside it: nothing to difference.
    assert sampler.steps_within(start - 60, end)["worker_steps_window"] is None
    assert sampler.steps_within(end + 60, end + 120)["worker_steps_window"] is None


def test_sampler_gpu_memory_peak(core_stack, tmp_path):
    # Stand-in for the driver's tool: two GPUs, the busier one's use rising then falling across calls.
    counter = tmp_path / "calls"
    counter.write_text("0")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
n=$(cat {counter}); echo $((n + 1)) > {counter}
case $n in 0) u=1000; b=0;; 1) u=5000; b=90;; 2) u=3000; b=[N/A];; *) u=3000; b=100;; esac
echo "$u, 81559, $b"
echo "200, 81559, 7"
""")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    s = ServerSampler(core_stack.url, interval_s=0.1, gpu_interval_s=0.0, nvidia_smi=str(smi)).start()
    deadline = time.monotonic() + 20
    while int(counter.read_text() or 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    report = s.stop()
    assert int(counter.read_text()) >= 4
    assert report["gpu_memory_used_peak_mib"] == 5000.0 and report["gpu_memory_total_mib"] == 81559.0
    # Busy share of the GPU holding the most memory (not the idle one's 7%), from the samples in the point:
    # not the baseline (call 0, before any request) nor stop()'s last call; the [N/A] sample (call 2) is
    # left out.
    calls = int(counter.read_text())
    expected = [0.9] + [1.0] * (calls - 4)
    assert report["gpu_busy_samples"] == len(expected)
    assert report["gpu_busy_mean"] == pytest.approx(sum(expected) / len(expected))
    assert report["gpu_busy_min"] == 0.9


def test_the_busy_share_of_a_window_leaves_out_the_samples_before_and_after_it(tmp_path):
    """busy_within() takes the samples read inside a span of monotonic time alone: a point's warm-up, when the
    GPU idles until requests arrive, no longer pulls its measured window's share down."""
    counter = tmp_path / "calls"
    counter.write_text("0")
    smi = tmp_path / "nvidia-smi"
    # Stand-in for the driver's tool: idle for two calls (the warm-up), then 80%, 100%, then idle again.
    smi.write_text(f"""#!/bin/sh
n=$(cat {counter}); echo $((n + 1)) > {counter}
case $n in 0|1) b=0;; 2) b=80;; 3) b=100;; *) b=0;; esac
echo "1000, 81559, $b"
""")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    sampler = ServerSampler("http://127.0.0.1:1", nvidia_smi=str(smi))
    marks = []
    for call in range(5):
        if call in (2, 4):
            marks.append(time.monotonic())
        sampler._gpu_memory(busy=True)
    report = sampler.report()
    assert report["gpu_busy_samples"] == 5 and report["gpu_busy_mean"] == pytest.approx(0.36)
    window = sampler.busy_within(*marks)
    assert window == {"gpu_busy_window_mean": pytest.approx(0.9), "gpu_busy_window_min": 0.8,
                      "gpu_busy_window_samples": 2}
    assert sampler.busy_within(marks[1] + 60, marks[1] + 120) == {
        "gpu_busy_window_mean": None, "gpu_busy_window_min": None, "gpu_busy_window_samples": 0}
