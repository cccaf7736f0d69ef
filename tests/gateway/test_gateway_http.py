"""The gateway process over real HTTP, with its scheduler and adapter_store played on real ZeroMQ sockets."""
import json
import threading
import time

import httpx
import numpy as np
import pytest

from services.gateway.tokenizer import ModelTokenizer
from shared.wire import RegisterAdapter, RequestRejected, TokenOutput
from tests.gateway.peers import card

TEXT = "héllo wörld ✓ 你好"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return ModelTokenizer(tiny_model_dir)


def stream_text(ids, delay=0.0, reason="length"):
    """A script: one token per TokenOutput, the last one finished."""
    def script(submit):
        return [(delay, TokenOutput(submit.request_id, np.array([t], np.int32), i == len(ids) - 1,
                                    reason if i == len(ids) - 1 else None)) for i, t in enumerate(ids)]
    return script


def sse_events(response):
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_returns_detokenized_text_and_usage(gateway, peers, tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    peers.script = stream_text(ids)
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "The quick", "max_tokens": 20,
                                                          "temperature": 0.5, "top_p": 0.9, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == TEXT and body["choices"][0]["finish_reason"] == "length"
    prompt = tok.encode("The quick")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    submit = peers.submits[-1]
    assert list(submit.prompt_ids) == prompt and submit.adapter is None and submit.max_tokens == 20
    assert (submit.temperature, submit.top_p, submit.seed, submit.stop_token_ids) == (0.5, 0.9, 7, [2])


def test_streaming_completion_never_splits_characters_and_reports_usage(gateway, peers, tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    peers.script = stream_text(ids)
    with httpx.stream("POST", gateway.url + "/v1/completions", json={
            "model": "tiny", "prompt": [1, 5, 9], "max_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)
    chunks = events[:-2]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == TEXT and all("\ufffd" not in t for t in texts)
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert list(peers.submits[-1].prompt_ids) == [1, 5, 9]


def test_chat_renders_the_template_and_streams_a_role_first(gateway, peers, tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + [2]
    peers.script = stream_text(ids, reason="stop")
    messages = [{"role": "user", "content": "Hello"}]
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert body["choices"][0]["finish_reason"] == "stop"
    submit = peers.submits[-1]
    assert list(submit.prompt_ids) == tok.encode_chat(messages)
    assert submit.max_tokens == 64 - len(submit.prompt_ids)  # chat defaults to the rest of the context
    with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                      json={"model": "tiny", "messages": messages, "stream": True}) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "Hi there"
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


def test_stop_string_cuts_the_text_and_aborts_the_request(gateway, peers, tok):
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    peers.script = stream_text(ids, delay=0.02)
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 30, "stop": ["brown"]})
    body = r.json()
    assert body["choices"][0]["text"] == "The quick " and body["choices"][0]["finish_reason"] == "stop"
    rid = peers.submits[-1].request_id
    peers.wait_for(lambda: any(a.request_id == rid and a.reason == "stop_string" for a in peers.aborts))


def test_adapter_model_is_resolved_for_the_callers_tenant(gateway, peers):
    peers.cards[("", "sql-lora")] = card("sql-lora")
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "sql-lora", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert peers.submits[-1].adapter == "sql-lora@0123456789abcdef"


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 80}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
])
def test_bad_requests_are_refused_before_anything_is_queued(gateway, peers, path, body, status, param):
    r = httpx.post(gateway.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert peers.submits == []


def test_malformed_json_and_oversized_bodies(gateway, peers):
    r = httpx.post(gateway.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(gateway.url + "/v1/completions", content=b"x" * (8 * 2**20 + 1))
    assert r.status_code == 413
    assert peers.submits == []


def test_refusal_from_the_scheduler_is_an_http_error_with_retry_after(gateway, peers):
    peers.script = lambda s: [(0.0, RequestRejected(s.request_id, 429, "queue_full", "the waiting queue is full", 3.0))]
    for stream in (False, True):
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "queue_full"


def test_client_disconnect_mid_stream_aborts_the_request(gateway, peers):
    peers.script = stream_text(list(range(10, 60)), delay=0.05)
    with httpx.stream("POST", gateway.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    rid = peers.submits[-1].request_id
    abort = peers.wait_for(lambda: next((a for a in peers.aborts if a.request_id == rid), None))
    assert abort.reason == "client_disconnect"


def test_client_disconnect_while_queued_aborts_the_request(gateway, peers):
    peers.script = lambda s: []  # never scheduled
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=0.5)
    rid = peers.submits[-1].request_id
    peers.wait_for(lambda: any(a.request_id == rid for a in peers.aborts))


def test_worker_failure_before_and_after_the_first_token(gateway, peers):
    peers.script = lambda s: [(0.0, TokenOutput(s.request_id, np.zeros(0, np.int32), True, "error", error="engine exploded"))]
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 500 and "engine exploded" in r.json()["error"]["message"]
    peers.script = lambda s: [(0.0, TokenOutput(s.request_id, np.array([337], np.int32))),
                              (0.05, TokenOutput(s.request_id, np.zeros(0, np.int32), True, "error", error="worker w0 failed"))]
    with httpx.stream("POST", gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["text"] == "The"
    assert "worker w0 failed" in events[1]["error"]["message"] and events[-1] == "[DONE]"


def test_models_list_base_and_adapters_with_residency(gateway, peers):
    peers.cards[("", "on-gpu")] = card("on-gpu", rank=16)
    peers.cards[("", "in-ram")] = card("in-ram", host=True)
    peers.cards[("", "on-disk")] = card("on-disk")
    peers.cards[("", "going")] = card("going", status="deleting")
    peers.resident.append(card("on-gpu").id)
    time.sleep(0.3)  # a ping round brings the worker's residency
    data = httpx.get(gateway.url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert data[0]["id"] == "tiny" and data[0]["parent"] is None
    assert set(by_id) == {"tiny", "on-gpu", "in-ram", "on-disk"}
    assert (by_id["on-gpu"]["residency"], by_id["in-ram"]["residency"], by_id["on-disk"]["residency"]) == ("gpu", "host", "disk")
    assert by_id["on-gpu"]["parent"] == "tiny" and by_id["on-gpu"]["rank"] == 16
    assert by_id["on-gpu"]["target_modules"] == ["q_proj", "v_proj"]


def last_registration(peers) -> RegisterAdapter:
    """The store's last RegisterAdapter (the gateway's periodic pings arrive among the calls)."""
    return [c for c in peers.store_calls if isinstance(c, RegisterAdapter)][-1]


def test_adapter_management_routes(gateway, peers):
    files = {"adapter_config": ("adapter_config.json", b'{"r": 8}'), "adapter_model": ("adapter_model.safetensors", b"\x00" * 1000)}
    r = httpx.post(gateway.url + "/v1/adapters", data={"name": "new-one"}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "new-one" and r.json()["residency"] == "disk"
    sent = last_registration(peers)
    assert (sent.name, sent.config_json, sent.model_safetensors) == ("new-one", b'{"r": 8}', b"\x00" * 1000)
    assert httpx.post(gateway.url + "/v1/adapters", data={"name": "new-one"}, files=files).status_code == 200
    r = httpx.post(gateway.url + "/v1/adapters", json={"name": "from-path", "path": "/srv/adapters/x"})
    assert r.status_code == 201 and last_registration(peers).path == "/srv/adapters/x"
    assert [a["name"] for a in httpx.get(gateway.url + "/v1/adapters").json()["data"]] == ["new-one", "from-path"]
    assert httpx.get(gateway.url + "/v1/adapters/from-path").json()["id"] == "from-path@0123456789abcdef"
    assert httpx.delete(gateway.url + "/v1/adapters/from-path").status_code == 204
    r = httpx.get(gateway.url + "/v1/adapters/from-path")
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    r = httpx.post(gateway.url + "/v1/adapters", data={"name": "x"}, files={"adapter_config": ("a.json", b"{}")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_model"


def test_vllm_aliases(gateway, peers):
    r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": "/srv/v"})
    assert r.status_code == 200 and "added" in r.text
    assert last_registration(peers).path == "/srv/v"
    assert httpx.post(gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 200
    assert httpx.post(gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 404


def test_health_ready_metrics_and_unknown_paths(gateway, peers):
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    assert httpx.get(gateway.url + "/ready").status_code == 200
    httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    text = httpx.get(gateway.url + "/metrics").text
    assert 'loraplex_requests_total{endpoint="completions",status="200"}' in text
    assert "loraplex_queue_depth 7.0" in text
    assert "loraplex_scheduler_newest_first 1.0" in text
    assert "loraplex_scheduler_prefill_estimate_seconds 1.25" in text
    assert 'loraplex_pool_slots{kind="free",worker="w0"} 900.0' in text
    assert 'loraplex_adapter_loads_total{worker="w0"} 3.0' in text
    assert "loraplex_time_to_first_token_seconds_count" in text
    r = httpx.get(gateway.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    peers.workers_ready = 0
    time.sleep(0.3)
    r = httpx.get(gateway.url + "/ready")
    assert r.status_code == 503 and r.json()["checks"]["worker"] is False


def test_silent_scheduler_fails_open_requests_cleanly(gateway, peers):
    peers.script = lambda s: []
    peers.scheduler_answers = False
    started = time.monotonic()
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "scheduler_unavailable"
    assert time.monotonic() - started < 6
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503  # refused up front while the scheduler is away
    peers.scheduler_answers = True
    peers.script = stream_text([337])
    time.sleep(0.3)
    assert httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_store_restart_fails_calls_the_old_process_never_answered(gateway, peers):
    peers.store_holds = (RegisterAdapter,)
    result = {}

    def upload():
        result["r"] = httpx.post(gateway.url + "/v1/adapters", json={"name": "lost", "path": "/srv/lost"}, timeout=30)

    caller = threading.Thread(target=upload)
    caller.start()
    peers.wait_for(lambda: any(isinstance(c, RegisterAdapter) for c in peers.store_calls))
    started = time.monotonic()
    peers.store_pid += 1  # the next Pong comes from a new store process
    caller.join(10)
    assert result["r"].status_code == 503 and result["r"].json()["error"]["code"] == "store_unavailable"
    assert time.monotonic() - started < 2
