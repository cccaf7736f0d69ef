"""The load client against a real stack: records complete and consistent with what the server itself
counted, arrivals sent open-loop, failures recorded per request without ending the run; the SSE reader
against the gateway's own framing split at every byte."""
from __future__ import annotations

import asyncio

import pytest

from bench.client import STREAMS_PER_CLIENT, RequestRecord, _Clients, _Stream, auto_processes, prompt_ids, run_trace
from bench.workload import TraceRequest, make_trace
from services.gateway.sse import DONE, event
from shared.ports import free_port
from shared.probes import metric
from shared.tiny_model import VOCAB_SIZE
from tests.bench.conftest import BASE_MODEL, demo_model_for


def server_tokens(stack) -> tuple[float, float]:
    text = stack.metrics()
    return metric(text, "loraplex_prompt_tokens_total"), metric(text, "loraplex_generation_tokens_total")


def check_complete(recs: list[RequestRecord], trace: list[TraceRequest]) -> None:
    assert [r.index for r in recs] == [t.index for t in trace]
    for r, t in zip(recs, trace):
        assert r.error is None and r.status == 200 and r.completed, r
        assert (r.adapter, r.prompt_len, r.output_len, r.arrival_s) == (t.adapter, t.prompt_len, t.output_len, t.arrival_s)
        assert r.arrival_s <= r.sent_s <= r.first_token_s <= r.finish_s, r
        assert r.output_tokens == r.output_len  # ignore_eos: exactly max_tokens
        # Open loop: sent at its arrival time (the client's own lag only, far below any service time).
        assert r.sent_s - r.arrival_s < 0.5, r


def test_trace_is_served_and_recorded(core_stack):
    trace = make_trace(4, 1.0, req_rate=10.0, cv=1.0, duration_s=2.0, seed=3, prompt_range=(4, 48), output_range=(2, 24))
    assert 12 <= len(trace) <= 30

    def model_for(r: TraceRequest) -> str:
        return BASE_MODEL if r.index % 5 == 0 else demo_model_for(r)

    prompt0, gen0 = server_tokens(core_stack)
    recs = asyncio.run(run_trace(core_stack.url, trace, model_for, VOCAB_SIZE, progress=True, seed=1, processes=1))
    check_complete(recs, trace)
    # The server counted the same prompt and output tokens the trace asked for.
    prompt1, gen1 = server_tokens(core_stack)
    assert prompt1 - prompt0 == sum(t.prompt_len for t in trace)
    assert gen1 - gen0 == sum(t.output_len for t in trace)


def test_arrivals_are_sent_whatever_the_server_is_doing(core_stack):
    # 24 requests arrive at once (more than one AsyncClient carries), each taking the server a good
    # fraction of a second: all are sent before any has finished (a closed-loop or capped client would
    # wait for answers).
    trace = [TraceRequest(i, 0.0, i % 4, 16, 64) for i in range(STREAMS_PER_CLIENT + 8)]
    recs = asyncio.run(run_trace(core_stack.url, trace, demo_model_for, VOCAB_SIZE, progress=False, processes=1))
    check_complete(recs, trace)
    assert max(r.sent_s for r in recs) < min(r.finish_s for r in recs)


def test_client_processes_share_one_timeline(core_stack):
    trace = make_trace(4, 1.0, req_rate=12.0, cv=2.0, duration_s=1.5, seed=8, prompt_range=(4, 32), output_range=(2, 12))
    _, gen0 = server_tokens(core_stack)
    recs = asyncio.run(run_trace(core_stack.url, trace, demo_model_for, VOCAB_SIZE, progress=False, processes=2))
    check_complete(recs, trace)
    assert server_tokens(core_stack)[1] - gen0 == sum(t.output_len for t in trace)


def test_failures_are_recorded_per_request(core_stack):
    trace = [TraceRequest(i, 0.05 * i, i % 4, 8, 6) for i in range(6)]
    # The model's whole context: outlives the timeout below on the fastest CPU (~1 ms a token).
    trace.append(TraceRequest(6, 0.3, 0, 8, 2040))

    def model_for(r: TraceRequest) -> str:
        return "no-such-adapter" if r.index == 2 else demo_model_for(r)

    recs = asyncio.run(run_trace(core_stack.url, trace, model_for, VOCAB_SIZE, request_timeout_s=1.0, progress=False,
                                 processes=1))
    bad, slow = recs[2], recs[6]
    assert bad.status == 404 and bad.error.startswith("HTTP 404:") and "no-such-adapter" in bad.error
    assert not bad.completed and bad.first_token_s is None and bad.finish_s >= bad.sent_s
    assert slow.error.startswith("timeout") and not slow.completed
    assert slow.finish_s - slow.sent_s == pytest.approx(1.0, abs=0.5)
    assert all(r.completed and r.output_tokens == r.output_len for i, r in enumerate(recs) if i not in (2, 6))

    # Out-of-vocabulary prompt ids: the server's 400 names the problem in every record.
    recs = asyncio.run(run_trace(core_stack.url, trace[:2], demo_model_for, 10**6, progress=False, processes=1))
    assert all(r.status == 400 and "out of range" in r.error for r in recs)


def test_streams_pack_onto_few_clients():
    made = []
    clients = _Clients(lambda: made.append(object()) or made[-1])
    first = [clients.acquire() for _ in range(STREAMS_PER_CLIENT + 1)]
    assert first == [0] * STREAMS_PER_CLIENT + [1] and len(made) == 2
    clients.release(0)
    assert clients.acquire() == 0 and len(made) == 2  # a freed place on the first client is reused
    assert clients.acquire() == 1


def test_client_processes_follow_the_offered_token_rate(monkeypatch):
    heavy = make_trace(100, 1.0, 40.0, 1.0, 60.0, seed=0)  # ~40 req/s of ~260 tokens: ~10k tokens/s
    light = make_trace(100, 1.0, 2.0, 1.0, 60.0, seed=0)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert auto_processes(heavy) == 5 and auto_processes(light) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # a small machine keeps the one event loop
    assert auto_processes(heavy) == 1


def test_unreachable_server_fails_each_request_not_the_run():
    trace = [TraceRequest(i, 0.01 * i, None, 8, 8) for i in range(5)]
    recs = asyncio.run(run_trace(f"http://127.0.0.1:{free_port()}", trace, lambda r: "m", 100, progress=False,
                                 processes=1))
    assert all(r.status is None and r.error.startswith("ConnectError") and r.finish_s is not None for r in recs)


def test_bad_arguments():
    trace = [TraceRequest(0, 0.0, 0, 8, 8)]
    with pytest.raises(ValueError, match="vocab_size"):
        asyncio.run(run_trace("http://127.0.0.1:1", trace, lambda r: "m", 0))
    with pytest.raises(ValueError, match="processes"):
        asyncio.run(run_trace("http://127.0.0.1:1", trace, lambda r: "m", 10, processes=0))
    with pytest.raises(KeyError):  # the caller's mapping fails before anything is sent
        asyncio.run(run_trace("http://127.0.0.1:1", trace, lambda r: {}[r.adapter], 10))


def test_prompts_fixed_by_seed_and_index():
    a = prompt_ids(1, 7, 300, 512)
    assert len(a) == 300 and min(a) >= 0 and max(a) < 512 and len(set(a)) > 100
    assert a == prompt_ids(1, 7, 300, 512) and a != prompt_ids(1, 8, 300, 512) and a != prompt_ids(2, 7, 300, 512)


def gateway_stream(texts: list[str], completion_tokens: int, error: str | None = None) -> bytes:
    """A completion stream framed by the gateway's own SSE code, as services/gateway/inference.py sends it."""
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    out = b""
    for i, t in enumerate(texts):
        reason = "length" if i == len(texts) - 1 and error is None else None
        out += event({**base, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": reason}], "usage": None})
    if error is not None:
        out += event({"error": {"message": error, "type": "server_error", "param": None, "code": "generation_failed"}})
    else:
        out += event({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens,
                                                         "total_tokens": 3 + completion_tokens}})
    return out + DONE


@pytest.mark.parametrize("crlf", [False, True])
def test_stream_reader_at_every_split(crlf):
    # Text that looks like the reader's markers must not fool it (JSON escapes its quotes).
    texts = ["Hel", 'lo "error": x', "\n\ndata: [DONE]\n\n", '"completion_tokens"', "é"]
    raw = gateway_stream(texts, completion_tokens=9)
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    for cut in range(1, len(raw)):
        s = _Stream()
        firsts = [s.feed(raw[:cut]), s.feed(raw[cut:])]
        assert firsts.count(True) == 1 and s.first and s.done and s.error is None
        assert s.output_tokens == 9 and s.chunks == len(texts)
        assert firsts[0] == (cut >= raw.index(b"\n\n" if not crlf else b"\r\n\r\n") + (2 if not crlf else 4))


def test_stream_reader_without_usage_counts_text_chunks_and_sees_errors():
    s = _Stream()
    raw = gateway_stream(["a", "", "b"], completion_tokens=0)
    s.feed(raw[:raw.rindex(b"data: {")] + DONE)  # drop the usage chunk
    assert s.done and s.output_tokens == 2
    s = _Stream()
    s.feed(gateway_stream(["a", "b"], 0, error="the worker died"))
    assert s.error == "stream error: the worker died" and s.done
