"""KV exhaustion under load, through HTTP: a worker whose pool holds a fraction of what the concurrent
requests need preempts (frees and later recomputes) instead of failing; every request finishes with exactly
the tokens a roomy pool gives, streaming or not, base model or adapter."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from shared.probes import metric
from tests.reliability.conftest import (
    Outcome,
    idle_without_leaks,
    plain_request,
    stream_request,
)

# 8 requests x (5 prompt + 120 generated) tokens need 1000 KV slots, plus the adapter's rows (rank 8: 88
# slots): far more than 240, while any one request with its adapter fits (213). Requests last long enough
# that they overlap even when they reach the worker spread out, so the pool must run out while they decode.
TINY_POOL_SLOTS = 240
MAX_TOKENS = 120
MODELS = ["model", "demo-000", "model", "demo-000", "demo-000", "model", "demo-000", "model"]


def run_all(stack) -> list[tuple[str, int]]:
    """All requests at once; (text, completion tokens) of each, in order."""
    def one(i: int):
        payload = {"model": MODELS[i], "prompt": [1, 40 + i, 41, 42 + i, 43], "max_tokens": MAX_TOKENS,
                   "temperature": 0, "ignore_eos": True}
        out = Outcome()
        if i % 2:
            stream_request(stack.url, payload, out)
            assert out.status == 200 and out.done and out.terminals == ["length"], out
            text = "".join(c["text"] for e in out.events for c in e.get("choices", []))
            return text, out.completion_tokens
        plain_request(stack.url, payload, out)
        assert out.status == 200, (out.status, out.body, out.error)
        return out.body["choices"][0]["text"], out.body["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(MODELS)) as pool:
        return list(pool.map(one, range(len(MODELS))))


def preemptions(stack) -> float:
    return metric(stack.metrics(), "loraplex_preemptions_total", worker="worker-0")


def test_tiny_pool_preempts_under_load_and_outputs_equal_a_roomy_pool(stack_factory, general_stack):
    tiny = stack_factory("kv-tiny", "--demo-adapters", "2", "--num-slots", str(TINY_POOL_SLOTS),
                         "--set", "worker.max_running_requests=8", "--set", "scheduler.first_token_slo_s=0")
    assert metric(tiny.metrics(), "loraplex_pool_slots", worker="worker-0", kind="total") == TINY_POOL_SLOTS

    roomy_before = preemptions(general_stack)
    roomy = run_all(general_stack)
    assert preemptions(general_stack) == roomy_before, "the roomy pool should not need to preempt"

    tiny_before = preemptions(tiny)
    squeezed = run_all(tiny)
    assert preemptions(tiny) > tiny_before, "the tiny pool never preempted: the test lost its point"
    # Each preempted request had its prompt's 5 tokens computed at least, computed again once readmitted.
    recomputed = metric(tiny.metrics(), "loraplex_recomputed_tokens_total", worker="worker-0")
    assert recomputed >= 5 * (preemptions(tiny) - tiny_before)
    assert all(n == MAX_TOKENS for _, n in squeezed)
    assert squeezed == roomy
    idle_without_leaks(tiny)


def test_a_full_decode_reserve_serves_the_same_tokens_without_preempting(stack_factory, general_stack):
    # Admission keeps every running request's remaining output slots free: requests wait in the worker
    # instead of being preempted and recomputed, and finish with the same tokens.
    reserved = stack_factory("kv-reserved", "--demo-adapters", "2", "--num-slots", str(TINY_POOL_SLOTS),
                             "--set", "worker.max_running_requests=8", "--set", "scheduler.first_token_slo_s=0",
                             "--set", "worker.decode_reserve=1.0", "--set", "worker.decode_reserve_low=1.0")
    assert metric(reserved.metrics(), "loraplex_decode_reserve_share", worker="worker-0") == 1.0
    roomy = run_all(general_stack)
    got = run_all(reserved)
    assert preemptions(reserved) == 0
    assert metric(reserved.metrics(), "loraplex_recomputed_tokens_total", worker="worker-0") == 0
    assert all(n == MAX_TOKENS for _, n in got)
    assert got == roomy
    idle_without_leaks(reserved)
