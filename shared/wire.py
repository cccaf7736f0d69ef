"""Every message that crosses a process boundary, and its encoding on ZeroMQ.

A message is a list of frames: ``[type, payload, *buffers]``.

- ``type`` is the message class name in ascii (``b"SubmitRequest"``), so a process can route on it
  without decoding the payload.
- ``payload`` is a msgpack map of field name -> value. Nested messages (a request inside ``Assign``,
  one request's tokens inside ``TokenBatch``) are maps too.
- Token id arrays travel as raw int32 little-endian bytes and decode with ``numpy.frombuffer``, without a
  copy. Small ones sit inline in the payload as msgpack ``bin``; large arrays and large byte fields
  (an uploaded safetensors file) go in their own trailing frame, referenced from the payload, so neither
  side copies them through msgpack.

``decode`` is strict: an unknown type, a missing required field, an extra field or a value of the wrong
type raises ``WireError`` naming the message and the field. New fields go last and carry a default, so a
message from an older sender that lacks them still decodes.

Adapter identity: the engine, scheduler and workers name an adapter by its ``AdapterCard.id``
(``adapter_id(tenant, name, sha256)``): re-registering a name with other content yields another id,
so a stale copy cached in a worker's GPU pool can never be used under the new content.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack
import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
# Arrays and byte strings at least this large travel in their own frame instead of inside the payload.
OUT_OF_BAND_BYTES = 4096
# msgpack extension code for "the value is trailing frame number N" (N as 4 bytes little-endian).
_EXT_FRAME = 1


class WireError(ValueError):
    """A frame list that is not a well-formed message of a known type."""


class TokenIds(np.ndarray):
    """Annotation marker: a 1-D int32 token id array (any int sequence is accepted when encoding)."""


def tokens(values: Any) -> np.ndarray:
    """A token id array in wire form (1-D int32); rejects values that do not fit in int32."""
    if isinstance(values, np.ndarray) and values.dtype == TOKEN_DTYPE and values.ndim == 1:
        return values
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise WireError(f"token ids must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
    if arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max:
        raise WireError("token ids must fit in int32")
    return arr.astype(TOKEN_DTYPE)


def adapter_id(tenant: str, name: str, sha256: str) -> str:
    """Stable id of one registration: same tenant, name and content -> same id."""
    owner = f"{tenant}:" if tenant else ""
    return f"{owner}{name}@{sha256[:16]}"


# --------------------------------------------------------------------------------------------------
# Registry of message types

MESSAGE_TYPES: dict[bytes, type] = {}


def message(cls):
    """Class decorator: a dataclass message, registered under its class name."""
    cls = dataclass(cls)
    name = cls.__name__.encode("ascii")
    if name in MESSAGE_TYPES:
        raise TypeError(f"duplicate message type {cls.__name__}")
    cls.TYPE = name
    MESSAGE_TYPES[name] = cls
    return cls


def record(cls):
    """Class decorator: a dataclass that only travels nested inside messages."""
    return dataclass(cls)


class Message:
    """Base of every top-level message; ``TYPE`` is its type frame."""

    TYPE: ClassVar[bytes] = b""


# --------------------------------------------------------------------------------------------------
# Requests: gateway -> scheduler -> worker -> gateway


@message
class SubmitRequest(Message):
    """A validated, tokenized generation request, as the gateway hands it to the scheduler."""

    request_id: str
    prompt_ids: TokenIds
    adapter: str | None = None  # AdapterCard.id, or None for the base model
    tenant: str = ""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k cut
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    arrival_time: float = 0.0  # time.time() at the gateway
    gateway_id: str = ""  # ZeroMQ identity of the gateway that streams this request's tokens


@message
class AbortRequest(Message):
    """Gateway -> scheduler: stop a request (client disconnect, timeout)."""

    request_id: str
    reason: str = "client_disconnect"


@message
class RequestRejected(Message):
    """Scheduler -> gateway: a request that will not run (queue full, SLO cannot be met, draining)."""

    request_id: str
    status: int  # HTTP status the gateway answers with (429, 503, ...)
    code: str
    message: str
    retry_after: float | None = None


@message
class Assign(Message):
    """Scheduler -> worker: requests to run."""

    requests: list[SubmitRequest]


@message
class WorkerAbort(Message):
    """Scheduler -> worker: stop these requests and free their slots."""

    request_ids: list[str]


@message
class PrefetchHint(Message):
    """Scheduler -> worker: adapters needed soon, most urgent first."""

    adapters: list[str]


@message
class WorkerStatus(Message):
    """Worker -> scheduler, every step: capacity and residency, so the scheduler can route and admit."""

    worker_id: str
    step: int
    total_slots: int
    free_slots: int
    kv_slots: int
    adapter_slots: int
    running: int
    waiting: int
    resident_adapters: list[str]
    finished_request_ids: list[str]
    ready: bool = True
    max_running: int = 0  # requests it runs at once at most; 0 = unknown (the scheduler's default applies)
    # Requests it wants queued beyond max_running: with a full batch it admits in rounds of this many, which
    # it can only do if that many wait on it (0 = none).
    backlog: int = 0
    adapter_loads: int = 0  # adapters copied into the GPU pool since the worker started
    adapter_load_bytes: int = 0  # bytes of those copies
    preemptions: int = 0  # running requests preempted (KV freed, recomputed later) since the worker started
    recomputed_tokens: int = 0  # tokens whose K/V those preemptions freed, computed again once readmitted
    # The share of running requests' remaining output whose KV slots admission keeps free now (decode_reserve;
    # 0 = none kept).
    decode_reserve_share: float = 0.0
    evictable_slots: int = 0  # adapter slots of unused resident adapters, KV's on demand (unified pool)
    # Since the worker started, by kind of step (graph, decode, prefill; services/gpu_worker/step_stats.py):
    # steps run, seconds from their scheduling until their tokens reached the host, and tokens computed;
    # of those seconds, the ones until the step's last kernel was launched (the host's part).
    step_counts: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)
    step_tokens: dict[str, int] = field(default_factory=dict)
    step_launch_seconds: dict[str, float] = field(default_factory=dict)
    step_ahead_counts: dict[str, int] = field(default_factory=dict)  # of the steps, those launched ahead
    # Distinct adapters whose rows the steps' LoRA kernels read, and the bytes of those rows, summed over steps.
    step_adapters: dict[str, int] = field(default_factory=dict)
    step_adapter_bytes: dict[str, int] = field(default_factory=dict)
    # Contexts read by one-token rows, (query, key) pairs of prompt chunks, rows sampled (step_stats.py).
    step_decode_keys: dict[str, int] = field(default_factory=dict)
    step_prompt_pairs: dict[str, int] = field(default_factory=dict)
    step_sampled: dict[str, int] = field(default_factory=dict)
    # Decode graphs captured at first use inside the steps, and the host's seconds in them (step_stats.py).
    step_captures: dict[str, int] = field(default_factory=dict)
    step_capture_seconds: dict[str, float] = field(default_factory=dict)
    # Triton kernel variants built while the steps were issued, and the host's seconds in them (step_stats.py).
    step_builds: dict[str, int] = field(default_factory=dict)
    step_build_seconds: dict[str, float] = field(default_factory=dict)
    # The GPU's time from timed steps' first kernel to their last, and how many were timed (CUDA only).
    step_gpu_seconds: dict[str, float] = field(default_factory=dict)
    step_gpu_counts: dict[str, int] = field(default_factory=dict)
    # Steps not launched ahead of the last one's tokens (overlap_steps), by why (step_stats.HELD_BACK_REASONS).
    steps_held_back: dict[str, int] = field(default_factory=dict)


@record
class TokenOutput:
    """New tokens of one request in one step (a delta, not the whole output)."""

    request_id: str
    token_ids: TokenIds
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@message
class TokenBatch(Message):
    """Worker -> gateway: every request's new tokens of one step."""

    worker_id: str
    outputs: list[TokenOutput]


# --------------------------------------------------------------------------------------------------
# Adapter management: gateway -> adapter_store. Every request carries a call_id the reply echoes, so one
# DEALER socket can have several calls in flight.


@message
class RegisterAdapter(Message):
    """Register an adapter from uploaded files, or from a folder under the store's allowed root."""

    name: str
    tenant: str = ""
    config_json: bytes | None = None
    model_safetensors: bytes | None = None
    path: str | None = None
    call_id: str = ""


@message
class ListAdapters(Message):
    """The tenant's adapters and the shared ones; every tenant's with all_tenants (admin listing)."""

    tenant: str = ""
    call_id: str = ""
    all_tenants: bool = False


@message
class GetAdapter(Message):
    """Resolve a name for a tenant: its own adapter first, then a shared one (tenant "")."""

    name: str
    tenant: str = ""
    call_id: str = ""


@message
class DeleteAdapter(Message):
    name: str
    tenant: str = ""
    call_id: str = ""


@message
class AdapterCard(Message):
    """What the store knows about one registered adapter."""

    id: str
    name: str
    tenant: str
    rank: int
    target_modules: list[str]
    sha256: str
    bytes: int
    created: float
    status: str  # "ready" or "deleting"
    host_resident: bool = False
    call_id: str = ""


@message
class AdapterRegistered(Message):
    """Reply to RegisterAdapter: ``created`` is False when the same name and content already existed."""

    card: AdapterCard
    created: bool
    call_id: str = ""


@message
class AdapterDeleted(Message):
    name: str
    tenant: str = ""
    call_id: str = ""


@message
class AdapterList(Message):
    cards: list[AdapterCard]
    call_id: str = ""


@message
class StoreError(Message):
    """A refused store call; ``status`` is the HTTP status the gateway answers with."""

    status: int
    code: str
    message: str
    param: str | None = None
    call_id: str = ""


# --------------------------------------------------------------------------------------------------
# Worker <-> adapter_store


@message
class AcquireAdapter(Message):
    """Pin an adapter in the host arena (loading it first if needed) and learn where its rows are."""

    adapter: str  # AdapterCard.id
    worker_id: str
    call_id: str = ""


@message
class AdapterLocation(Message):
    """Where an acquired adapter's PackedAdapter rows sit in the shared-memory arena.

    The bytes at [offset, offset + nbytes) of segment are a C-contiguous array of ``dtype`` with
    ``shape`` [num_layers, 2, n_slots, slot_width]; they stay put until the matching ReleaseAdapter.
    """

    adapter: str
    segment: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    ranks: list[int]
    a_off: list[int]
    b_off: list[int]
    call_id: str = ""


@message
class ReleaseAdapter(Message):
    """Drop one pin taken by AcquireAdapter. Replies with Ack only when call_id is set."""

    adapter: str
    worker_id: str
    call_id: str = ""


@message
class ReleaseWorker(Message):
    """Drop every pin a worker holds (sent when a worker died; its restart starts with an empty pool).
    Replies with Ack only when call_id is set."""

    worker_id: str
    call_id: str = ""


@message
class WarmAdapters(Message):
    """Load adapters into the arena ahead of use (from prefetch hints). Replies with Ack only when
    call_id is set, once they are loaded."""

    adapters: list[str]
    call_id: str = ""


@message
class Ack(Message):
    call_id: str = ""


# --------------------------------------------------------------------------------------------------
# Health


@message
class Ping(Message):
    call_id: str = ""


@message
class Pong(Message):
    service: str
    ready: bool = True
    pid: int = 0
    call_id: str = ""
    workers_ready: int = 0  # scheduler only: workers that reported ready and are alive
    queue_depth: int = 0  # scheduler only: requests in the waiting queue
    newest_first: bool = False  # scheduler only: its last scheduling decision served the queue newest first
    # scheduler only: its estimate of assignment to first token for the longest prompt seen (early abort's bar)
    prefill_estimate_s: float = 0.0
    # adapter_store only: the host arena, so leaks of pins or bytes show in the gateway's /metrics
    arena_capacity_bytes: int = 0
    arena_used_bytes: int = 0
    arena_pinned_bytes: int = 0
    arena_adapters: int = 0
    arena_pins: int = 0  # acquisitions not yet released, summed over adapters and workers
    arena_name: str = ""  # its shared-memory segment, which CUDA workers pin while they start
    arena_loads: int = 0  # adapters laid into the arena since the store started
    arena_evictions: int = 0
    blob_reads: int = 0  # adapters read from disk for workers and hints (never more than one at once each)
    packed_reads: int = 0  # of those, read as packed rows (one read into the arena, no repack)


# --------------------------------------------------------------------------------------------------
# Encoding


class _Schema:
    """Resolved field types of one dataclass, computed once."""

    def __init__(self, cls: type):
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        self.cls = cls
        self.fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
        self.names = {name for name, _ in self.fields}
        self.required = {
            f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    s = _SCHEMAS.get(cls)
    if s is None:
        s = _SCHEMAS[cls] = _Schema(cls)
    return s


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[Any] = []

    def out_of_band(self, buf) -> msgpack.ExtType:
        self.buffers.append(buf)
        return msgpack.ExtType(_EXT_FRAME, (len(self.buffers) - 1).to_bytes(4, "little"))

    def value(self, v: Any, tp: Any) -> Any:
        if tp is TokenIds:
            arr = np.ascontiguousarray(tokens(v))
            if arr.nbytes >= OUT_OF_BAND_BYTES:
                return self.out_of_band(memoryview(arr).cast("B"))
            return arr.tobytes()
        if isinstance(v, (bytes, bytearray, memoryview)) and len(v) >= OUT_OF_BAND_BYTES:
            return self.out_of_band(v)
        if dataclasses.is_dataclass(v):
            return self.record(v)
        if isinstance(v, (list, tuple)):
            item_tp = _item_type(tp)
            return [self.value(x, item_tp) for x in v]
        return v

    def record(self, obj: Any) -> dict:
        schema = _schema(type(obj))
        return {name: self.value(getattr(obj, name), tp) for name, tp in schema.fields}


def _item_type(tp: Any) -> Any:
    """Element type of list[T] (or of an optional list); Any when it cannot be told."""
    for arg in _options(tp):
        if typing.get_origin(arg) in (list, tuple):
            args = typing.get_args(arg)
            return args[0] if args else Any
    return Any


def _options(tp: Any) -> tuple:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _plain(v: Any) -> Any:
    # numpy scalars (a sampled token, a slot count) are common in fields typed int/float.
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"cannot serialize {type(v).__name__}")


def encode(msg: Message) -> list:
    """Frames of a message: [type, payload, *out-of-band buffers] (buffers are sent without copying)."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", b"")) is not cls:
        raise WireError(f"{cls.__name__} is not a wire message type")
    enc = _Encoder()
    try:
        payload = msgpack.packb(enc.record(msg), use_bin_type=True, default=_plain)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {cls.__name__}: {e}") from e
    return [cls.TYPE, payload, *enc.buffers]


def _as_buffer(frame: Any) -> Any:
    """bytes or memoryview of a frame; zmq.Frame (copy=False receive) exposes .buffer."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


class _Decoder:
    def __init__(self, type_name: str, buffers: list[Any]):
        self.type_name = type_name
        self.buffers = buffers

    def fail(self, path: str, problem: str) -> WireError:
        return WireError(f"{self.type_name}.{path}: {problem}" if path else f"{self.type_name}: {problem}")

    def frame(self, ext: Any, path: str) -> Any:
        if not isinstance(ext, msgpack.ExtType) or ext.code != _EXT_FRAME or len(ext.data) != 4:
            raise self.fail(path, "malformed out-of-band reference")
        index = int.from_bytes(ext.data, "little")
        if index >= len(self.buffers):
            raise self.fail(path, f"refers to frame {index + 2} but the message has {len(self.buffers) + 2} frames")
        return self.buffers[index]

    def value(self, v: Any, tp: Any, path: str) -> Any:
        options = _options(tp)
        if len(options) > 1:
            if v is None and type(None) in options:
                return None
            concrete = [o for o in options if o is not type(None)]
            errors = []
            for option in concrete:
                try:
                    return self.value(v, option, path)
                except WireError as e:
                    errors.append(str(e))
            raise errors[0] if len(errors) == 1 else self.fail(path, f"value does not match {tp}")
        if tp is Any:
            return v
        if tp is TokenIds:
            if isinstance(v, msgpack.ExtType):
                v = self.frame(v, path)
            if not isinstance(v, (bytes, memoryview, bytearray)):
                raise self.fail(path, f"expected token ids as raw bytes, got {type(v).__name__}")
            if len(v) % TOKEN_DTYPE.itemsize:
                raise self.fail(path, f"token id bytes length {len(v)} is not a multiple of 4")
            return np.frombuffer(v, dtype=TOKEN_DTYPE)
        if tp is bytes:
            if isinstance(v, msgpack.ExtType):
                v = self.frame(v, path)
            if isinstance(v, (memoryview, bytearray)):
                return bytes(v)
            if isinstance(v, bytes):
                return v
            raise self.fail(path, f"expected bytes, got {type(v).__name__}")
        if tp is bool:
            if isinstance(v, bool):
                return v
            raise self.fail(path, f"expected bool, got {type(v).__name__}")
        if tp is int:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            raise self.fail(path, f"expected int, got {type(v).__name__}")
        if tp is float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            raise self.fail(path, f"expected float, got {type(v).__name__}")
        if tp is str:
            if isinstance(v, str):
                return v
            raise self.fail(path, f"expected str, got {type(v).__name__}")
        if tp is type(None):
            if v is None:
                return None
            raise self.fail(path, f"expected null, got {type(v).__name__}")
        origin = typing.get_origin(tp)
        if origin in (list, tuple):
            if not isinstance(v, list):
                raise self.fail(path, f"expected a list, got {type(v).__name__}")
            item_tp = _item_type(tp)
            items = [self.value(x, item_tp, f"{path}[{i}]") for i, x in enumerate(v)]
            return items if origin is list else tuple(items)
        if origin is dict:
            key_tp, val_tp = typing.get_args(tp) or (Any, Any)
            if not isinstance(v, dict):
                raise self.fail(path, f"expected a map, got {type(v).__name__}")
            return {self.value(k, key_tp, path): self.value(x, val_tp, f"{path}[{k!r}]") for k, x in v.items()}
        if dataclasses.is_dataclass(tp):
            return self.record(v, tp, path)
        raise self.fail(path, f"no decoder for field type {tp}")

    def record(self, v: Any, cls: type, path: str) -> Any:
        if not isinstance(v, dict):
            raise self.fail(path, f"expected a map of {cls.__name__} fields, got {type(v).__name__}")
        schema = _schema(cls)
        extra = [k for k in v if k not in schema.names]
        if extra:
            raise self.fail(path, f"unknown field(s) {', '.join(map(repr, extra))} for {cls.__name__}")
        missing = sorted(schema.required - v.keys())
        if missing:
            prefix = f"{path}." if path else ""
            raise self.fail(path, f"missing field(s) {', '.join(prefix + m for m in missing)}")
        kwargs = {}
        for name, tp in schema.fields:
            if name in v:
                kwargs[name] = self.value(v[name], tp, f"{path}.{name}" if path else name)
        return cls(**kwargs)


def message_type(frames: list) -> bytes:
    """The type frame, for routing without decoding."""
    if not frames:
        raise WireError("empty message: no type frame")
    return bytes(_as_buffer(frames[0]))


def decode(frames: list) -> Message:
    """A typed message from [type, payload, *buffers]; raises WireError for anything else."""
    if len(frames) < 2:
        raise WireError(f"a message needs a type frame and a payload frame, got {len(frames)} frame(s)")
    type_name = message_type(frames)
    cls = MESSAGE_TYPES.get(type_name)
    if cls is None:
        raise WireError(f"unknown message type {type_name[:64]!r}")
    name = cls.__name__
    try:
        payload = msgpack.unpackb(_as_buffer(frames[1]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise WireError(f"{name}: payload is not valid msgpack ({e})") from None
    buffers = [_as_buffer(f) for f in frames[2:]]
    return _Decoder(name, buffers).record(payload, cls, "")
