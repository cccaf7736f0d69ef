"""The wire protocol: every message round-trips, malformed frames are refused with a named cause."""
import dataclasses

import msgpack
import numpy as np
import pytest
import zmq

from shared import wire
from shared.wire import (
    AdapterCard, AdapterList, AdapterLocation, AdapterRegistered, Assign, SubmitRequest, TokenBatch,
    TokenOutput, WireError, decode, encode, tokens,
)


def _card(name="alpha"):
    return AdapterCard(id=wire.adapter_id("", name, "ab" * 32), name=name, tenant="", rank=8,
                       target_modules=["q_proj", "v_proj"], sha256="ab" * 32, bytes=1234, created=1.5, status="ready")


def _example(cls):
    """A value for every field of a message, derived from its annotations so new messages are covered."""
    samples = {
        str: "x-1", int: 7, float: 0.25, bool: True, bytes: b"\x00\x01payload",
        wire.TokenIds: tokens([5, 6, 7]),
    }

    def value(tp):
        options = wire._options(tp)
        tp = next(o for o in options if o is not type(None))
        if tp in samples:
            return samples[tp]
        origin = __import__("typing").get_origin(tp)
        if origin in (list, tuple):
            return [value(wire._item_type(tp))]
        if origin is dict:
            key_tp, val_tp = __import__("typing").get_args(tp)
            return {value(key_tp): value(val_tp)}
        if dataclasses.is_dataclass(tp):
            return _example(tp)
        raise AssertionError(f"no sample for {tp}")

    schema = wire._schema(cls)
    return cls(**{name: value(tp) for name, tp in schema.fields})


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and b.dtype == np.int32 and a.tolist() == b.tolist()
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("cls", list(wire.MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
def test_every_message_round_trips_with_its_type_in_the_first_frame(cls):
    msg = _example(cls)
    frames = encode(msg)
    assert frames[0] == cls.__name__.encode()
    assert wire.message_type(frames) == cls.TYPE
    assert _same(msg, decode(frames))


def test_defaults_fill_fields_an_older_sender_did_not_know():
    payload = msgpack.packb({"request_id": "r", "prompt_ids": tokens([1, 2]).tobytes()})
    req = decode([b"SubmitRequest", payload])
    assert req.max_tokens == 16 and req.adapter is None and req.stop_token_ids == []
    assert req.prompt_ids.tolist() == [1, 2]


def test_small_token_arrays_travel_inline_and_large_ones_in_their_own_frame():
    small = TokenBatch("w0", [TokenOutput("a", tokens([1, 2, 3]))])
    assert len(encode(small)) == 2
    n = wire.OUT_OF_BAND_BYTES // 4 + 10
    big = SubmitRequest("r", np.arange(n, dtype=np.int64))
    frames = encode(big)
    assert len(frames) == 3 and bytes(frames[2]) == np.arange(n, dtype="<i4").tobytes()
    frame = bytearray(bytes(frames[2]))
    out = decode([frames[0], frames[1], frame])
    # Decoding reads the ids straight out of the received frame.
    assert np.shares_memory(out.prompt_ids, np.frombuffer(frame, dtype=np.uint8))
    assert out.prompt_ids.tolist() == list(range(n))


def test_large_upload_bytes_go_out_of_band_and_come_back_equal():
    blob = bytes(range(256)) * 100
    frames = encode(wire.RegisterAdapter("a", config_json=b"{}", model_safetensors=blob))
    assert len(frames) == 3 and len(frames[1]) < 200
    assert decode(frames).model_safetensors == blob


def test_nested_messages_round_trip():
    reqs = [SubmitRequest(f"r{i}", tokens(range(i + 1)), adapter=None if i % 2 else "a@1", seed=i) for i in range(5)]
    out = decode(encode(Assign(reqs)))
    assert [r.request_id for r in out.requests] == [f"r{i}" for i in range(5)]
    assert [r.prompt_ids.tolist() for r in out.requests] == [list(range(i + 1)) for i in range(5)]
    assert _same(AdapterList([_card("a"), _card("b")]), decode(encode(AdapterList([_card("a"), _card("b")]))))
    reg = decode(encode(AdapterRegistered(_card(), created=False, call_id="c9")))
    assert reg.card.name == "alpha" and reg.created is False and reg.call_id == "c9"


def test_numpy_scalars_encode_as_plain_numbers():
    loc = AdapterLocation("a", "seg", np.int64(4096), np.int64(64), "float32", [1, 2, 3, 4], [8] * 7, [0] * 7, [0] * 7)
    out = decode(encode(loc))
    assert out.offset == 4096 and type(out.offset) is int


@pytest.mark.parametrize("frames, problem", [
    ([], "got 0 frame(s)"),
    ([b"SubmitRequest"], "needs a type frame and a payload"),
    ([b"Bogus", msgpack.packb({})], "unknown message type b'Bogus'"),
    ([b"Ping", b"\xc1"], "not valid msgpack"),
    ([b"Ping", msgpack.packb([1, 2])], "expected a map of Ping fields"),
    ([b"Ping", msgpack.packb({"call_id": "a", "extra": 1})], "unknown field(s) 'extra'"),
    ([b"AbortRequest", msgpack.packb({})], "missing field(s) request_id"),
    ([b"AbortRequest", msgpack.packb({"request_id": 5})], "AbortRequest.request_id: expected str, got int"),
    ([b"WorkerAbort", msgpack.packb({"request_ids": "r1"})], "expected a list"),
    ([b"WorkerAbort", msgpack.packb({"request_ids": ["a", 2]})], "request_ids[1]: expected str"),
    ([b"Pong", msgpack.packb({"service": "s", "ready": 1})], "ready: expected bool"),
    ([b"SubmitRequest", msgpack.packb({"request_id": "r", "prompt_ids": [1, 2]})], "expected token ids as raw bytes"),
    ([b"SubmitRequest", msgpack.packb({"request_id": "r", "prompt_ids": b"\x00" * 5})], "not a multiple of 4"),
    ([b"SubmitRequest", msgpack.packb({"request_id": "r", "prompt_ids": msgpack.ExtType(1, (3).to_bytes(4, "little"))})],
     "refers to frame 5"),
    ([b"TokenBatch", msgpack.packb({"worker_id": "w", "outputs": [{"request_id": "r"}]})], "outputs[0]: missing field(s) outputs[0].token_ids"),
    ([b"AdapterRegistered", msgpack.packb({"card": {"id": "x"}, "created": True})], "card: missing field(s)"),
])
def test_malformed_frames_are_refused_with_the_cause_named(frames, problem):
    with pytest.raises(WireError) as err:
        decode(frames)
    assert problem in str(err.value)


def test_encode_refuses_values_that_are_not_messages_or_tokens():
    with pytest.raises(WireError, match="not a wire message"):
        encode(TokenOutput("r", tokens([1])))
    with pytest.raises(WireError, match="fit in int32"):
        encode(SubmitRequest("r", [2**40]))
    with pytest.raises(WireError, match="1-D sequence of integers"):
        encode(SubmitRequest("r", [[1, 2]]))
    with pytest.raises(WireError, match="cannot encode"):
        encode(wire.Ping(call_id=object()))


def test_messages_cross_a_real_zeromq_socket_pair_without_copies():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        n = 5000
        dealer.send_multipart(encode(TokenBatch("w0", [TokenOutput("r", np.arange(n), True, "length", 3, n)])), copy=False)
        assert router.poll(5000)
        identity, *frames = router.recv_multipart(copy=False)
        out = decode(frames)
        assert out.outputs[0].token_ids.tolist() == list(range(n))
        assert out.outputs[0].finish_reason == "length"
        router.send_multipart([identity.bytes, *encode(wire.Pong("adapter_store", call_id="z"))])
        assert dealer.poll(5000)
        assert decode(dealer.recv_multipart()).call_id == "z"
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
