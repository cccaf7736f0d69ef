"""The gateway's OpenAPI document (GET /openapi.json) is accurate, and schema-driven fuzzing of every
operation in it (schemathesis, valid and invalid requests) against a running stack gets only 2xx/4xx
answers, each one documented and shaped as documented; the server is alive and serving afterwards."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks as sc

from services.gateway.app import ROUTES
from tests.reliability.conftest import idle_without_leaks

MAX_EXAMPLES = 12  # per operation and phase: enough to cover every field, small enough for CI
FUZZ_MAX_TOKENS = 4  # generation is the slow part on a CPU; validation of max_tokens is fuzzed all the same


@pytest.fixture(scope="module")
def api_schema(general_stack):
    loaded = schemathesis.openapi.from_url(f"{general_stack.url}/openapi.json")
    # Valid requests (which must run or be refused for a reason the schema cannot see, like an unknown
    # model) and invalid ones (which must be refused with a 4xx).
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode))
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def test_document_lists_exactly_the_routes_the_gateway_serves(general_stack):
    with general_stack.client() as c:
        doc = c.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, item in doc["paths"].items() for method in item
                  if method in ("get", "post", "put", "patch", "delete")}
    served = {(route.path, method) for route in ROUTES for method in route.methods if method != "HEAD"}
    assert documented == served
    limits = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert limits["prompt"]["anyOf"][1]["items"]["maximum"] == 511  # the tiny model's vocabulary is 512


ANSWERS: list[tuple[str, str, int]] = []  # (method, path, status) of every fuzzed call
SERVED = ["model", "demo-000", "demo-001"]


def _positive(case) -> bool:
    mode = getattr(getattr(getattr(case, "meta", None), "generation", None), "mode", None)
    return "positive" in str(mode).lower()


def _cheap(case) -> None:
    """Make valid generation requests reach the engine and keep them short: half of them name a model the
    server has (random names are 404s), a valid max_tokens becomes small, an absent one is set."""
    body = case.body
    if case.path in ("/v1/completions", "/v1/chat/completions") and isinstance(body, dict):
        if _positive(case) and isinstance(body.get("model"), str) and len(repr(body)) % 2:
            body["model"] = SERVED[len(repr(body)) % len(SERVED)]
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            # The document sets no upper bound (the server checks it against the prompt), so a large value is
            # never what makes a negative case invalid: shrinking it keeps every case what it was.
            if isinstance(value, int) and not isinstance(value, bool) and value > FUZZ_MAX_TOKENS:
                body[key] = FUZZ_MAX_TOKENS
        if _positive(case) and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = FUZZ_MAX_TOKENS


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_fuzzed_requests_get_documented_2xx_or_4xx_answers(case):
    _cheap(case)
    response = case.call(timeout=60)
    ANSWERS.append((case.method, case.path, response.status_code))
    case.validate_response(response, checks=[
        sc.not_a_server_error, sc.status_code_conformance, sc.content_type_conformance,
        sc.response_schema_conformance, sc.response_headers_conformance, sc.negative_data_rejection,
    ])


def test_server_alive_and_clean_after_fuzzing(general_stack):
    generated = [a for a in ANSWERS if a[1] in ("/v1/completions", "/v1/chat/completions") and a[2] == 200]
    refused = [a for a in ANSWERS if 400 <= a[2] < 500]
    assert len(generated) >= 5 and len(refused) >= 50, f"the fuzzing missed the engine or the validation: {ANSWERS}"
    with general_stack.client() as c:
        assert c.get("/ready").status_code == 200
        r = c.post("/v1/completions", json={"model": "model", "prompt": [1, 5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert {"demo-000", "demo-001"} <= {m["id"] for m in c.get("/v1/models").json()["data"]}
    idle_without_leaks(general_stack)


@pytest.mark.parametrize("field, value", [("echo", 0), ("logprobs", 0), ("n", True), ("best_of", True),
                                          ("presence_penalty", False)])
def test_neutral_fields_take_their_json_type_only(general_stack, field, value):
    """Found by the fuzzing: 0 == False and True == 1 in Python, not in JSON; the document says which."""
    with general_stack.client() as c:
        r = c.post("/v1/completions", json={"model": "model", "prompt": [1, 5], "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_sampling_values_below_fp32_range_do_not_crash_the_worker(general_stack):
    """Found by the fuzzing: top_p=5e-324 compared as 0 in fp32 and masked every token, the sampler raised
    and the worker died with every request it held. Such values are valid; they must be served."""
    worker = general_stack.service_pids()["worker-0"]
    with general_stack.client() as c:
        for fields in ({"top_p": 5e-324}, {"temperature": 5e-324}, {"temperature": 1e-30, "top_p": 1e-45}):
            r = c.post("/v1/completions", json={"model": "model", "prompt": [1, 5], "max_tokens": 2, **fields})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (fields, r.text)
    assert general_stack.service_pids()["worker-0"] == worker
    assert "worker.engine_failed" not in general_stack.log()
