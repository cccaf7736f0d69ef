"""Request bodies of /v1/completions and /v1/chat/completions, checked before anything is queued.

Every refusal is a 400 naming the offending field. Fields OpenAI defines that we do not implement are
accepted only at their neutral value (n=1, no logprobs, zero penalties...), so a client never silently
gets a different behaviour from the one it asked for; unknown fields are refused, as OpenAI does.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import ApiError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512
INT64 = (-(2**63), 2**63 - 1)

COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
ROLES = ("system", "developer", "user", "assistant")


@dataclass
class GenerationRequest:
    """What the gateway will run, after validation (prompt not yet tokenized)."""

    model: str
    chat: bool
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; malformed JSON (including NaN/Infinity) or another type -> 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad_request(f"{name} must be a number, got {json.dumps(v)[:40]}", name, "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise bad_request(f"{name} must be in {bracket}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _neutral(body: dict, name: str, neutral: tuple) -> None:
    v = body.get(name)
    # Booleans match booleans only: in Python 0 == False and True == 1, in JSON they are different values.
    if v is not None and not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
        raise bad_request(f"{name}={json.dumps(v)[:40]} is not supported by this server", name, "unsupported_parameter")


def _common(body: dict, allowed: set[str], chat: bool) -> GenerationRequest:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a non-empty string", "model",
                          "missing_required_parameter" if model is None else "invalid_type")
    req = GenerationRequest(model=model, chat=chat)

    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise bad_request(f"{name} must be an integer, got {json.dumps(v)[:40]}", name, "invalid_type")
        if v < 1:
            raise bad_request(f"{name} must be at least 1, got {v}", name)
        req.max_tokens = v
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise bad_request(f"top_k must be an integer, got {json.dumps(top_k)[:40]}", "top_k", "invalid_type")
        if top_k < -1:
            raise bad_request(f"top_k must be -1 (off) or positive, got {top_k}", "top_k")
        req.top_k = -1 if top_k == 0 else top_k
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise bad_request(f"seed must be an integer, got {json.dumps(seed)[:40]}", "seed", "invalid_type")
        if not INT64[0] <= seed <= INT64[1]:
            raise bad_request("seed must fit in a signed 64-bit integer", "seed")
        req.seed = seed
    req.stop = _stop(body.get("stop"))
    for name in ("stream", "ignore_eos"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise bad_request(f"{name} must be a boolean, got {json.dumps(v)[:40]}", name, "invalid_type")
    req.stream = bool(body.get("stream"))
    req.ignore_eos = bool(body.get("ignore_eos"))
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request("stream_options must be an object with include_usage", "stream_options", "invalid_type")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage", "invalid_type")
        req.include_usage = include
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user", "invalid_type")
    _neutral(body, "n", (1,))
    _neutral(body, "presence_penalty", (0, 0.0))
    _neutral(body, "frequency_penalty", (0, 0.0))
    if body.get("logit_bias") not in (None, {}):
        raise bad_request("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
    return req


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise bad_request(f"each stop string must be 1 to {MAX_STOP_LENGTH} characters long", "stop")
    return stops


def parse_completion(body: dict) -> GenerationRequest:
    req = _common(body, COMPLETION_FIELDS, chat=False)
    _neutral(body, "logprobs", (False,))
    _neutral(body, "echo", (False,))
    _neutral(body, "best_of", (1,))
    _neutral(body, "suffix", ("",))
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    # OpenAI accepts a batch (list of prompts); one prompt per request is served here, in either form.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt", "unsupported_parameter")
    else:
        raise bad_request("prompt must be a string or a non-empty list of token ids", "prompt", "invalid_type")
    return req


def parse_chat(body: dict) -> GenerationRequest:
    req = _common(body, CHAT_FIELDS, chat=True)
    _neutral(body, "logprobs", (False,))
    _neutral(body, "top_logprobs", (0,))
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages", "invalid_type")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    return req


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    unknown = sorted(set(m) - {"role", "content", "name"})
    if unknown:
        raise bad_request(f"{where}.{unknown[0]} is not supported by this server", f"{where}.{unknown[0]}", "unsupported_parameter")
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}", f"{where}.role")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}]: only text parts are supported", f"{where}.content", "unsupported_parameter")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")
    out = {"role": role, "content": content}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        out["name"] = name
    return out


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range: the vocabulary has {vocab_size} tokens", param)


def resolve_max_tokens(req: GenerationRequest, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """Tokens to generate: as asked if prompt + output fit the context; else 400 naming the field."""
    param = "messages" if req.chat else "prompt"
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param)
    if prompt_len >= max_model_len:
        raise ApiError(400, f"the prompt is {prompt_len} tokens, but the model's context is {max_model_len} tokens "
                            f"and needs room for at least one generated token", param, "context_length_exceeded")
    room = max_model_len - prompt_len
    if req.max_tokens is None:
        return room if default is None else min(default, room)
    if req.max_tokens > room:
        raise ApiError(400, f"max_tokens={req.max_tokens} is too large: the prompt is {prompt_len} tokens and the "
                            f"model's context is {max_model_len}, so at most {room} tokens can be generated",
                       "max_tokens", "context_length_exceeded")
    return req.max_tokens
