"""GET /openapi.json: the gateway's HTTP contract as an OpenAPI 3.1 document.

Written by hand next to the code it describes (validation.py, adapters.py, ops.py), because the routes
take raw JSON and multipart bodies, not typed models a generator could read. The limits that depend on the
running server (vocabulary size, context length, upload cap) are filled in from its configuration, so the
document is exact for this server, and schema-driven fuzzing (tests/reliability/test_openapi_fuzz.py)
holds the server to it: every answer documented, only 2xx/4xx.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from services.gateway.status import HISTORY_POINTS, status_schema
from services.gateway.validation import INT64, MAX_STOP_LENGTH, MAX_STOP_STRINGS, ROLES

NAME_PATTERN = "^[a-z0-9][a-z0-9._-]{0,63}$"  # adapter_store/validation.py: names of adapters and tenants


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict:
    """Error answers: the OpenAI error body, with the headers some of them carry."""
    text = {400: "invalid request (the message and param name the problem)", 401: "missing or wrong API key",
            403: "the key may not do this", 404: "no such model, adapter or path", 409: "conflicts with a registration",
            413: "body over the size limit", 429: "queue full; retry after the given seconds",
            503: "not serving now (draining, or a service is restarting); retry after the given seconds"}
    out = {}
    for status in statuses:
        answer = {"description": text[status], "content": _json(_ref("Error"))}
        if status in (429, 503):
            answer["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        if status == 401:
            answer["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[str(status)] = answer
    return out


def _generation_fields(state) -> dict:
    """Fields common to completions and chat completions, as validation.py accepts them."""
    context = state.max_model_len
    return {
        "model": {"type": "string", "minLength": 1, "examples": [state.base_name],
                  "description": "the base model's name or an adapter name (anything else: 404)"},
        # The bound is the context less the prompt's tokens, known only after tokenizing (400 past it).
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "description": f"at most {context} - prompt tokens"}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "description": "-1 or 0: no cut (extension)"}),
        "seed": _nullable({"type": "integer", "minimum": INT64[0], "maximum": INT64[1]}),
        "stop": _nullable({"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH},
            {"type": "array", "maxItems": MAX_STOP_STRINGS,
             "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}}]}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({
            "type": "object", "additionalProperties": False, "description": "only with stream: true",
            "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {}}}),
        "ignore_eos": _nullable({"type": "boolean", "description": "extension: generate max_tokens tokens"}),
        "user": _nullable({"type": "string"}),
        # Accepted at their neutral value only: a client never silently gets another behaviour.
        "n": _nullable({"const": 1}),
        "presence_penalty": _nullable({"const": 0}),
        "frequency_penalty": _nullable({"const": 0}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
    }


# stream_options (when given, not null) needs stream: true.
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
INTEGERS = ("Integers are JSON integers: a number written with a fraction (4.0) is refused even where its value "
            "would do.")


def _completion_request(state) -> dict:
    vocab = state.model.vocab_size
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    text = {"type": "string", "description": "may be empty: the tokenizer's BOS token is the prompt then"}
    return {
        "type": "object", "additionalProperties": False, "required": ["model", "prompt"], "description": INTEGERS,
        **STREAM_OPTIONS_NEED_STREAM,
        "properties": {
            **_generation_fields(state),
            "prompt": {"anyOf": [text, token_ids,
                                 {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [text, token_ids]}}],
                       "description": "one prompt: text or token ids (a batch of exactly one is accepted too)"},
            "logprobs": _nullable({"const": False}),
            "echo": _nullable({"const": False}),
            "best_of": _nullable({"const": 1}),
            "suffix": _nullable({"const": ""}),
        },
    }


def _chat_request(state) -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {
        "type": "object", "additionalProperties": False, "required": ["role"],
        "properties": {
            "role": {"enum": list(ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}, {"type": "null"}],
                        "description": "absent or null only in assistant messages"},
            "name": {"type": ["string", "null"]},
        },
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
    }
    return {
        "type": "object", "additionalProperties": False, "required": ["model", "messages"], "description": INTEGERS,
        **STREAM_OPTIONS_NEED_STREAM,
        "properties": {
            **_generation_fields(state),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                                "description": "takes precedence over max_tokens"}),
            "logprobs": _nullable({"const": False}),
            "top_logprobs": _nullable({"const": 0}),
        },
    }


def _completion_object(object_name: str, content_key: str, content: dict, finish: dict) -> dict:
    """A non-streamed answer: completions and chat completions differ only in the object name and in what each
    choice carries (`text`, or an assistant `message`)."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", content_key, "finish_reason"],
                "properties": {"index": {"type": "integer"}, content_key: content, "logprobs": {"type": "null"},
                               "finish_reason": finish}}}}}


def _schemas(state) -> dict:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"enum": ["stop", "length", None]}
    card_props = {
        "id": {"type": "string"}, "object": {"const": "adapter"}, "name": {"type": "string"},
        "tenant": {"type": "string"}, "rank": {"type": "integer", "minimum": 1},
        "target_modules": {"type": "array", "items": {"type": "string"}},
        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}, "bytes": {"type": "integer", "minimum": 0},
        "created": {"type": "integer"}, "status": {"enum": ["ready", "deleting"]},
        "residency": {"enum": ["gpu", "host", "disk"]},
    }
    return {
        "Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
        "CompletionRequest": _completion_request(state),
        "ChatCompletionRequest": _chat_request(state),
        "Usage": usage,
        "Completion": _completion_object("text_completion", "text", {"type": "string"}, finish),
        "ChatCompletion": _completion_object(
            "chat.completion", "message", finish=finish,
            content={"type": "object", "required": ["role", "content"],
                     "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}),
        "Model": {
            "type": "object", "required": ["id", "object", "parent", "residency"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "root": {"type": "string"},
                           "parent": {"type": ["string", "null"]}, "max_model_len": {"type": "integer"},
                           "rank": {"type": "integer"}, "target_modules": {"type": "array", "items": {"type": "string"}},
                           "residency": {"enum": ["gpu", "host", "disk"]}}},
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "AdapterCard": {"type": "object", "required": list(card_props), "properties": card_props},
        "AdapterList": {"type": "object", "required": ["object", "data"],
                        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("AdapterCard")}}},
        "AdapterName": {"type": "string", "pattern": NAME_PATTERN},
        "Tenant": {"type": "string", "pattern": f"^({NAME_PATTERN[1:-1]})?$", "description": "empty = shared"},
        "StreamEvent": {"type": "object", "required": ["data"],
                        "description": "one server-sent event: data is a JSON chunk (a completion chunk, the usage "
                                       "chunk, or {\"error\": ...}) or the final [DONE]",
                        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}},
        "Status": status_schema(),
        "Readiness": {"type": "object", "required": ["status", "checks"],
                      "properties": {"status": {"enum": ["ready", "not ready"]},
                                     "checks": {"type": "object", "additionalProperties": {"type": "boolean"}}}},
    }


def _generation_operation(summary: str, request: str, response: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {
            "200": {"description": "the completion (JSON), or with stream: true server-sent events ending in "
                                   "`data: [DONE]`; a failure after the first token is an error event",
                    "content": {**_json(_ref(response)), "text/event-stream": {"schema": _ref("StreamEvent")}}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }


def document(state) -> dict:
    """The whole OpenAPI document for this gateway's configuration."""
    cfg = state.config
    name_param = {"name": "name", "in": "path", "required": True, "schema": _ref("AdapterName")}
    tenant_param = {"name": "tenant", "in": "query", "required": False, "schema": _ref("Tenant"),
                    "description": "namespace of the adapter (admin only); empty = shared"}
    register_form = {
        "type": "object", "additionalProperties": False, "required": ["name", "adapter_config", "adapter_model"],
        "properties": {"name": _ref("AdapterName"), "tenant": _ref("Tenant"),
                       "adapter_config": {"type": "string", "format": "binary", "contentMediaType": "application/json",
                                          "description": "adapter_config.json (PEFT)"},
                       "adapter_model": {"type": "string", "format": "binary",
                                         "contentMediaType": "application/octet-stream",
                                         "description": "adapter_model.safetensors (never a pickle)"}}}
    register_path = {"type": "object", "additionalProperties": False, "required": ["name", "path"],
                     "properties": {"name": _ref("AdapterName"), "tenant": _ref("Tenant"),
                                    "path": {"type": "string", "minLength": 1,
                                             "description": "a folder under the server's allowed root"}}}
    text_ok = {"description": "done", "content": {"text/plain": {"schema": {"type": "string"}}}}
    html = {"description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}}
    card = {"content": _json(_ref("AdapterCard"))}
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": "1",
                 "description": f"OpenAI-compatible completions for the base model {state.base_name!r} and its LoRA "
                                f"adapters, adapter management, health and metrics. Uploads are capped at "
                                f"{cfg.max_upload_bytes} bytes, other bodies at {cfg.max_body_bytes}."},
        "components": {
            "schemas": _schemas(state),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "admin key for adapter management, tenant keys for inference"}},
        },
        "security": [{"bearer": []}, {}],
        "paths": {
            "/v1/completions": {"post": _generation_operation("text completion", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generation_operation("chat completion", "ChatCompletionRequest", "ChatCompletion")},
            "/v1/models": {"get": {"summary": "the base model and the adapters the caller may use",
                                   "responses": {"200": {"description": "models", "content": _json(_ref("ModelList"))},
                                                 **_errors(401, 503)}}},
            "/v1/adapters": {
                "post": {"summary": "register an adapter: upload its two files, or name a folder under the allowed root",
                         "requestBody": {"required": True, "content": {
                             "multipart/form-data": {"schema": register_form,
                                                     "encoding": {"adapter_config": {"contentType": "application/json"},
                                                                  "adapter_model": {"contentType": "application/octet-stream"}}},
                             "application/json": {"schema": register_path}}},
                         "responses": {"201": {"description": "registered", **card},
                                       "200": {"description": "already registered with the same content", **card},
                                       **_errors(400, 401, 403, 404, 409, 413, 503)}},
                "get": {"summary": "every registered adapter (admin)",
                        "responses": {"200": {"description": "adapters", "content": _json(_ref("AdapterList"))},
                                      **_errors(401, 403, 503)}},
            },
            "/v1/adapters/{name}": {
                "parameters": [name_param, tenant_param],
                "get": {"summary": "one adapter's card (admin)",
                        "responses": {"200": {"description": "the card", **card}, **_errors(400, 401, 403, 404, 503)}},
                "delete": {"summary": "unlist at once; in-flight requests finish first (admin)",
                           "responses": {"204": {"description": "deleted"}, **_errors(400, 401, 403, 404, 503)}},
            },
            "/v1/load_lora_adapter": {"post": {
                "summary": "vLLM-compatible registration from a server path",
                "requestBody": {"required": True, "content": _json({
                    "type": "object", "additionalProperties": False, "required": ["lora_name", "lora_path"],
                    "properties": {"lora_name": _ref("AdapterName"), "lora_path": {"type": "string", "minLength": 1},
                                   "load_inplace": {}}})},
                "responses": {"200": text_ok, **_errors(400, 401, 403, 404, 409, 413, 503)}}},
            "/v1/unload_lora_adapter": {"post": {
                "summary": "vLLM-compatible deletion",
                "requestBody": {"required": True, "content": _json({
                    "type": "object", "additionalProperties": False, "required": ["lora_name"],
                    "properties": {"lora_name": _ref("AdapterName"), "lora_int_id": {}}})},
                "responses": {"200": text_ok, **_errors(400, 401, 403, 404, 413, 503)}}},
            "/health": {"get": {"summary": "the gateway process answers", "security": [],
                                "responses": {"200": {"description": "alive", "content": _json({
                                    "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}})}}}},
            "/ready": {"get": {"summary": "scheduler, store and a worker are up and requests are accepted", "security": [],
                               "responses": {
                                   "200": {"description": "ready", "content": _json(_ref("Readiness"))},
                                   "503": {"description": "not ready (see checks)", "content": _json(_ref("Readiness"))}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": [],
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/v1/status": {"get": {
                "summary": "workers, queue, pool slots, adapters per tier, rates and latencies in one document "
                           "(admin; what the dashboard and `loraplex status` show)",
                "parameters": [{"name": "history", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 0, "maximum": HISTORY_POINTS, "default": 0},
                                "description": "seconds of one-per-second chart points to include in series"}],
                "responses": {"200": {"description": "the status", "content": _json(_ref("Status"))},
                              **_errors(400, 401, 403)}}},
            "/dashboard": {"get": {"summary": "the live dashboard (HTML; reads /v1/status)", "security": [],
                                   "responses": {"200": html}}},
            "/dashboard/adapters": {"get": {"summary": "the adapters page (HTML; search, cards, upload, delete)",
                                            "security": [], "responses": {"200": html}}},
            "/static/{name}": {"get": {
                "summary": "a script, style sheet or icon of the pages", "security": [],
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the file", "content": {
                                  "text/javascript": {"schema": {"type": "string"}},
                                  "text/css": {"schema": {"type": "string"}},
                                  "image/svg+xml": {"schema": {"type": "string"}}}},
                              **_errors(404)}}},
            "/openapi.json": {"get": {"summary": "this document", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1",
                                                            "content": _json({"type": "object"})}}}},
        },
    }


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(document(request.app.state.gateway))
