"""The roofline: ceilings measured here (tiny sizes on a CPU), and per-request bytes and FLOPs that follow the
model's geometry exactly (BENCHMARKS.md "The limit")."""
import math
from dataclasses import replace

import pytest

from bench.held_matmul import held_tflops, run_windows
from bench.roofline import (
    Ceilings, decode_weight_bytes, held, kv_bytes_per_token, measure_ceilings, request_cost, roofline_fraction,
    roofline_rps, server_batch, trace_seconds,
)
from bench.settings import get_setting
from bench.workload import TraceRequest

S2 = get_setting("S2")
TINY = get_setting("tiny")
# Round figures (an H200's order of magnitude) so expected times can be written out by hand.
CEIL = Ceilings(device="cuda", name="test", hbm_gbs=4000.0, matmul_tflops=800.0, h2d_gbs=50.0, copy_bytes=0,
                matmul_n=0, matmul_dtype="bfloat16", pinned=True)


def req(i, prompt, output, adapter=None):
    return TraceRequest(index=i, arrival_s=float(i), adapter=adapter, prompt_len=prompt, output_len=output)


def test_ceilings_are_measured_on_a_cpu_too():
    c = measure_ceilings("cpu", copy_bytes=4 * 2**20, matmul_n=64, repeats=3)
    assert c.device == "cpu" and c.name == "cpu" and not c.pinned and c.matmul_dtype == "float32"
    for value in (c.hbm_gbs, c.matmul_tflops, c.h2d_gbs):
        assert math.isfinite(value) and value > 0
    assert c.as_dict()["copy_bytes"] == 4 * 2**20
    assert math.isfinite(c.matmul_held_tflops) and c.matmul_held_tflops > 0
    assert measure_ceilings("cpu", copy_bytes=2**20, matmul_n=32, repeats=2, held_s=0).matmul_held_tflops is None


def test_the_held_roofline_takes_the_held_matmul_rate_in_place_of_the_burst():
    assert held(CEIL) is None  # ceilings without it (given by hand, or lines from before it)
    power_capped = replace(CEIL, matmul_held_tflops=680.0)
    at_held = held(power_capped)
    assert at_held.matmul_tflops == 680.0 and at_held.hbm_gbs == CEIL.hbm_gbs
    trace = [req(i, 400, 100) for i in range(50)]
    # Prefill FLOPs take longer at the lower rate; decode bytes do not change: slower, but by less than the rate.
    slower = roofline_rps(S2, trace, at_held, 64) / roofline_rps(S2, trace, power_capped, 64)
    assert 680.0 / 800.0 < slower < 1.0


def test_the_held_rate_is_the_second_halfs_median_and_needs_two_windows():
    windows = [{"tflops": t} for t in (790.0, 700.0, 660.0, 670.0, 665.0)]
    assert held_tflops(windows) == 665.0
    with pytest.raises(ValueError, match="two windows"):
        held_tflops(windows[:1])
    ran = run_windows(32, 0.2, 0.02, "cpu", burst=3)
    assert len(ran) >= 2 and ran[0]["products"] == 3 and all(w["tflops"] > 0 for w in ran)


def test_kv_and_weight_bytes_follow_the_geometry():
    # Llama-2-7B: 32 layers x (K + V) x 4096 wide x 2 bytes per token.
    assert kv_bytes_per_token(S2) == 32 * 2 * 4096 * 2
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert decode_weight_bytes(S2) == 2 * (linears + (2 * 32 + 1) * 4096 + 4096 * 32000)


def test_doubling_the_context_adds_exactly_the_kv_it_reads():
    base = request_cost(S2, 200, 101, batch=64)
    doubled = request_cost(S2, 400, 101, batch=64)
    # 100 decode steps, each reading 200 more tokens of KV.
    assert doubled.kv_bytes - base.kv_bytes == 100 * 200 * kv_bytes_per_token(S2)
    assert doubled.weight_bytes == base.weight_bytes
    # Σ_{k=1}^{100} (200 + k) tokens at 512 KiB each.
    assert base.kv_bytes == (100 * 200 + 100 * 101 // 2) * 524288
    longer = request_cost(S2, 200, 201, batch=64)
    assert longer.kv_bytes == (200 * 200 + 200 * 201 // 2) * 524288
    assert longer.weight_bytes == pytest.approx(2 * base.weight_bytes)


def test_weights_and_adapters_are_shared_by_the_batch():
    one = request_cost(S2, 100, 11, batch=1, rank=16)
    many = request_cost(S2, 100, 11, batch=128, rank=16, adapter_sharers=4)
    assert many.weight_bytes == pytest.approx(one.weight_bytes / 128)
    assert many.adapter_bytes == pytest.approx(one.adapter_bytes / 4)
    assert one.adapter_bytes == 10 * S2.adapter_bytes(16)  # 10 decode steps read the whole adapter
    assert request_cost(S2, 100, 11, batch=1).adapter_bytes == 0  # the base model reads no adapter


def test_prefill_flops_grow_linearly_in_the_linears_and_quadratically_in_attention():
    cfg = S2.model_config
    f1 = request_cost(S2, 100, 2, batch=1, rank=8).prefill_flops
    f2 = request_cost(S2, 200, 2, batch=1, rank=8).prefill_flops
    attention = lambda p: 4 * cfg.q_dim * p * (p + 1) // 2 * cfg.num_layers  # noqa: E731
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    assert f2 - 2 * f1 == attention(200) - 2 * attention(100) - lm_head


def test_roofline_of_a_trace_is_requests_over_summed_times():
    trace = [req(0, 100, 11, adapter=0), req(1, 100, 11, adapter=0), req(2, 300, 51, adapter=1)]
    ranks = [8, 64]
    # Batch 2: the first two requests share adapter 0 in their window; the third is alone with adapter 1.
    costs = [request_cost(S2, 100, 11, 2, 8, 2), request_cost(S2, 100, 11, 2, 8, 2), request_cost(S2, 300, 51, 2, 64, 1)]
    by_hand = sum(c.decode_bytes / 4000e9 + c.prefill_flops / 800e12 for c in costs)
    assert trace_seconds(S2, trace, CEIL, 2, ranks) == pytest.approx(by_hand)
    rps = roofline_rps(S2, trace, CEIL, 2, ranks)
    assert rps == pytest.approx(3 / by_hand)
    assert roofline_fraction(rps / 4, S2, trace, CEIL, 2, ranks) == pytest.approx(0.25)
    # Twice the bandwidth and the matmul rate: twice the roofline.
    faster = Ceilings(**{**CEIL.as_dict(), "hbm_gbs": 8000.0, "matmul_tflops": 1600.0})
    assert roofline_rps(S2, trace, faster, 2, ranks) == pytest.approx(2 * rps)


def test_batch_is_the_servers_capped_by_the_pool_kv_and_adapters_together():
    trace = [req(i, 100, 100) for i in range(10)]  # mean context 150 tokens
    assert server_batch(S2, trace) == 256
    assert server_batch(S2, trace, pool_slots=150 * 40) == 40
    assert server_batch(S2, trace, max_running=16, pool_slots=10**6) == 16
    # The pool also holds the rows of the adapters such a batch uses: ten rank-8 S2 adapters take 32 slots each
    # (q, k, v, o: 8 rows of A and of Bᵀ a module, a row one slot wide), so 40 requests' KV no longer fits.
    tuned = [req(i, 100, 100, adapter=i) for i in range(10)]
    assert server_batch(S2, tuned, pool_slots=150 * 40, ranks=[8] * 10) == 37  # 37 · 150 + 320 ≤ 6000 < 38 · 150 + 320
    assert server_batch(S2, tuned, pool_slots=150 * 40, ranks=[0] * 10) == 40  # base-only: no rows
    assert server_batch(S2, tuned, max_running=16, pool_slots=10**6, ranks=[8] * 10) == 16


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="batch"):
        request_cost(TINY, 10, 10, batch=0)
    with pytest.raises(ValueError, match="empty trace"):
        roofline_rps(TINY, [], CEIL, 4)


def test_the_linears_bind_by_their_flops_past_the_ridge_point():
    from bench.roofline import linear_params

    # CEIL's ridge point: 800e12 / 4000e9 = 200 FLOPs a byte. A token's linears do 2 FLOPs a weight and read
    # its 2 bytes once for the batch: bound by bytes below 200 tokens a step, by FLOPs above.
    small = request_cost(S2, 100, 11, batch=64, rank=16, adapter_sharers=2)
    assert small.attainable_seconds(CEIL) == pytest.approx(small.seconds(CEIL), rel=1e-12)
    large = request_cost(S2, 100, 11, batch=400, rank=16, adapter_sharers=2)
    head = S2.model_config.hidden_size * S2.model_config.vocab_size
    # Ten decode steps; each adds the FLOPs' time over the bytes' time, for the linears and the LM head.
    extra = sum(10 * (2 * w / 800e12 - 2 * w / 400 / 4000e9) for w in (linear_params(S2), head))
    assert large.attainable_seconds(CEIL) - large.seconds(CEIL) == pytest.approx(extra, rel=1e-9)
    assert large.decode_linear_flops == 10 * 2 * linear_params(S2) and large.decode_head_flops == 10 * 2 * head
    # The bytes split the same way the roofline counts them: linears, LM head, and the norms left over.
    norms = (2 * 32 + 1) * 4096 * 2 * 10 / 400
    assert large.weight_bytes == pytest.approx(large.linear_weight_bytes + large.head_weight_bytes + norms)


def test_attainable_throughput_is_the_roofline_below_the_ridge_and_under_it_above():
    from bench.roofline import attainable_rps

    trace = [req(i, 64 + 7 * i, 20 + 3 * i, adapter=i % 3) for i in range(12)]
    ranks = [8, 16, 64]
    assert attainable_rps(S2, trace, CEIL, 8, ranks) == pytest.approx(roofline_rps(S2, trace, CEIL, 8, ranks))
    above = attainable_rps(S2, trace, CEIL, 384, ranks)
    assert above < roofline_rps(S2, trace, CEIL, 384, ranks)
    # Past the ridge a larger batch saves only the bytes of what stays bytes-bound (norms): nearly nothing.
    assert attainable_rps(S2, trace, CEIL, 768, ranks) == pytest.approx(above, rel=1e-3)
    with pytest.raises(ValueError, match="empty trace"):
        attainable_rps(S2, [], CEIL, 8)
