import pytest

from services.gateway.errors import ApiError
from services.gateway.validation import (
    check_prompt_ids, parse_chat, parse_completion, parse_json, resolve_max_tokens,
)


def refusal(fn, *args):
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"text"', b'{"temperature": NaN}', b"\xff\xfe", b"[" * 100_000])
def test_malformed_json_is_400(raw):
    e = refusal(parse_json, raw)
    assert (e.status, e.code) == (400, "invalid_json")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "", "prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "top_p": 1.01}, "top_p"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "seed": 2**64}, "seed"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": 3}, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
])
def test_bad_completion_fields_are_400_naming_the_field(body, param):
    e = refusal(parse_completion, body)
    assert e.status == 400 and e.param == param, e.message
    assert param in e.message or (param == "prompt" and "prompt" in e.message)


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_bad_chat_fields_are_400_naming_the_field(body, param):
    e = refusal(parse_chat, body)
    assert e.status == 400 and e.param == param, e.message


def test_good_requests_parse_to_what_will_run():
    req = parse_completion({"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 9, "temperature": 0, "top_p": 0.5,
                            "top_k": 0, "seed": -3, "stop": "##", "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True, "n": 1, "user": "u"})
    assert (req.prompt_ids, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == ([5, 6, 7], 9, 0.0, 0.5, -1, -3)
    assert (req.stop, req.stream, req.include_usage, req.ignore_eos) == (["##"], True, True, True)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                                   {"role": "assistant", "content": None}]})
    assert chat.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]


def test_lengths_are_checked_against_the_context():
    req = parse_completion({"model": "m", "prompt": "x", "max_tokens": 10})
    assert resolve_max_tokens(req, 90, 100, 16) == 10
    e = refusal(resolve_max_tokens, req, 91, 100, 16)
    assert (e.status, e.param, e.code) == (400, "max_tokens", "context_length_exceeded")
    e = refusal(resolve_max_tokens, req, 100, 100, 16)
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    unset = parse_completion({"model": "m", "prompt": "x"})
    assert resolve_max_tokens(unset, 95, 100, 16) == 5  # the default shrinks to what fits
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert resolve_max_tokens(chat, 40, 100, None) == 60
    e = refusal(check_prompt_ids, [1, 2, 512], 512, "prompt")
    assert e.param == "prompt" and "512" in e.message
