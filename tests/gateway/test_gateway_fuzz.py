"""Fuzzing every endpoint with arbitrary bodies: the answer is always 2xx or 4xx, never a 5xx."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
MODEL = st.sampled_from(["tiny", "nope", "", "../etc", "TINY"]) | JSON
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON,
                                              "content": st.text(max_size=30) | JSON, "name": JSON})
COMMON = {"model": MODEL, "max_tokens": st.integers(-2, 200) | JSON, "temperature": st.floats(-1, 3) | JSON,
          "top_p": st.floats(-0.5, 1.5) | JSON, "top_k": st.integers(-3, 50) | JSON, "seed": st.integers(-2**65, 2**65) | JSON,
          "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | JSON, "stream": st.booleans() | JSON,
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
          "ignore_eos": st.booleans() | JSON, "n": st.integers(0, 3) | JSON, "junk": JSON}
COMPLETION = st.fixed_dictionaries({}, optional={**COMMON, "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 600), max_size=80) | JSON})
CHAT = st.fixed_dictionaries({}, optional={**COMMON, "messages": st.lists(MESSAGE, max_size=3) | JSON})
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def client(gateway):
    with httpx.Client(base_url=gateway.url, timeout=10) as c:
        yield c


def _ok(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]


@FUZZ
@given(body=COMPLETION | JSON)
def test_completions_never_5xx(client, body):
    _ok(client.post("/v1/completions", json=body))


@FUZZ
@given(body=CHAT | JSON)
def test_chat_never_5xx(client, body):
    _ok(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/adapters",
                                                           "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]))
def test_raw_bytes_never_5xx(client, raw, path):
    _ok(client.post(path, content=raw, headers={"content-type": "application/json"}))


@FUZZ
@given(body=JSON, name=st.text(min_size=1, max_size=30))
def test_adapter_routes_never_5xx(client, body, name):
    _ok(client.post("/v1/adapters", json=body))
    _ok(client.post("/v1/load_lora_adapter", json=body))
    _ok(client.post("/v1/unload_lora_adapter", json=body))
    quoted = httpx.URL("/v1/adapters/").join(json.dumps(name)[1:-1].replace("/", "%2F").replace("?", "%3F").replace("#", "%23"))
    _ok(client.get(str(quoted)))
    _ok(client.delete(str(quoted)))


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(["name", "tenant", "adapter_config", "adapter_model", "other"]),
                              st.binary(max_size=50), max_size=5))
def test_multipart_uploads_never_5xx(client, fields):
    files = {k: (k + ".bin", v) for k, v in fields.items() if k.startswith("adapter")}
    data = {k: v.decode("latin-1") for k, v in fields.items() if not k.startswith("adapter")}
    _ok(client.post("/v1/adapters", data=data, files=files or {"x": ("x", b"")}))
