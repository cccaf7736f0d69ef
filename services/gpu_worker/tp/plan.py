"""The step plan rank 0 sends to the followers: everything they need to run the same forward on their shard.

A plan is a msgpack header plus raw tensor frames (no pickle): the batch's token ids, positions, output
slots, page table and LoRA token map, the adapters loaded into the pool since the last plan (resident id,
slots, table row) and, for the receiving rank only, those adapters' rows in its shard format. Slot ids and
resident ids are rank 0's; every rank's pool and tables use the same ids, so a plan means the same thing on
every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from ..adapter_layout import PackedAdapter
from ..model import ForwardBatch
from ..ops.meta import AttnMeta, LoraBatch, LoraTables

DTYPE_NAMES = {torch.int32: "int32", torch.int64: "int64", torch.float32: "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

# Message kinds on the control channel.
READY, ERROR, INIT, INIT_DONE, STEP, STOP = b"ready", b"error", b"init", b"init-done", b"step", b"stop"


class PlanError(ValueError):
    """A malformed plan (a bug or a version mismatch between ranks), named precisely."""


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, zero-copy for a contiguous CPU tensor (any dtype, bf16 included)."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def tensor_meta(t: torch.Tensor) -> list:
    if t.dtype not in DTYPE_NAMES:
        raise PlanError(f"cannot send a {t.dtype} tensor in a plan")
    return [DTYPE_NAMES[t.dtype], list(t.shape)]


def frame_tensor(meta: list, frame) -> torch.Tensor:
    dtype_name, shape = meta
    if dtype_name not in DTYPES:
        raise PlanError(f"unknown tensor dtype {dtype_name!r} in plan")
    dtype = DTYPES[dtype_name]
    data = bytearray(frame)  # writable and owned: torch must not alias the receive buffer
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise PlanError(f"tensor frame of {len(data)} bytes, expected {expected} for {dtype_name}{shape}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


@dataclass
class AdapterLoad:
    """An adapter rank 0 copied into the pool since the last plan; `shards` holds every rank's rows."""

    resident_id: int
    name: str
    slots: list[int]
    shards: list[PackedAdapter]

    def header(self) -> dict:
        p = self.shards[0]
        return {"rid": self.resident_id, "name": self.name, "slots": self.slots, "ranks": list(p.ranks),
                "a_off": list(p.a_off), "b_off": list(p.b_off), "rows": tensor_meta(p.rows)}


BATCH_TENSORS = ("input_ids", "positions", "out_slots", "q_start", "ctx_lens", "slot_table")
LORA_TENSORS = ("token_adapter",)


def encode_step(batch: ForwardBatch, loads: list[AdapterLoad]) -> tuple[bytes, list, list[list]]:
    """(header, frames common to all followers, per-load frames to pick by rank: `[load][rank]`)."""
    attn, lora = batch.attn, batch.lora
    tensors = {"input_ids": batch.input_ids, "positions": batch.positions, "out_slots": batch.out_slots,
               "q_start": attn.q_start, "ctx_lens": attn.ctx_lens, "slot_table": attn.slot_table}
    if lora is not None:
        tensors["token_adapter"] = lora.token_adapter
    header = {
        "tensors": [[name, *tensor_meta(t)] for name, t in tensors.items()],
        "max_q_len": attn.max_q_len, "max_ctx_len": attn.max_ctx_len, "decode_only": attn.decode_only,
        "max_rank": None if lora is None else list(lora.max_rank),
        "segment_lengths": None if lora is None or lora.segment_lengths is None else list(lora.segment_lengths),
        "loads": [load.header() for load in loads],
    }
    frames = [tensor_frame(t) for t in tensors.values()]
    load_frames = [[tensor_frame(s.rows) for s in load.shards] for load in loads]
    return msgpack.packb(header, use_bin_type=True), frames, load_frames


@dataclass
class LoadHeader:
    resident_id: int
    name: str
    slots: list[int]
    ranks: tuple[int, ...]
    a_off: tuple[int, ...]
    b_off: tuple[int, ...]
    rows: torch.Tensor


def decode_step(header_bytes, frames: list, tables: LoraTables, device: torch.device) -> tuple[ForwardBatch, list[LoadHeader]]:
    """A follower's ForwardBatch (on `device`, LoRA reading `tables`) and the adapter loads to apply first.
    `frames` are the batch tensors, then one shard frame per load."""
    try:
        header = msgpack.unpackb(bytes(header_bytes), raw=False)
        specs = header["tensors"]
        loads = header["loads"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise PlanError(f"unreadable step plan header ({type(e).__name__}: {e})") from e
    if len(frames) != len(specs) + len(loads):
        raise PlanError(f"step plan has {len(frames)} frames, expected {len(specs)} tensors + {len(loads)} adapter loads")
    t = {}
    for (name, dtype_name, shape), frame in zip(specs, frames):
        t[name] = frame_tensor([dtype_name, shape], frame).to(device, non_blocking=True)
    missing = [n for n in BATCH_TENSORS if n not in t]
    if missing:
        raise PlanError(f"step plan lacks tensors {missing}")
    attn = AttnMeta(q_start=t["q_start"], ctx_lens=t["ctx_lens"], slot_table=t["slot_table"],
                    max_q_len=header["max_q_len"], max_ctx_len=header["max_ctx_len"],
                    decode_only=header["decode_only"])
    lora = None
    if header["max_rank"] is not None:
        lora = LoraBatch(tables=tables, token_adapter=t["token_adapter"], max_rank=tuple(header["max_rank"]),
                         segment_lengths=None if header["segment_lengths"] is None else tuple(header["segment_lengths"]))
    batch = ForwardBatch(input_ids=t["input_ids"], positions=t["positions"], out_slots=t["out_slots"], attn=attn,
                         lora=lora, logits_index=torch.empty(0, dtype=torch.long, device=device))
    out = []
    for load, frame in zip(loads, frames[len(specs):]):
        out.append(LoadHeader(load["rid"], load["name"], list(load["slots"]), tuple(load["ranks"]),
                              tuple(load["a_off"]), tuple(load["b_off"]), frame_tensor(load["rows"], frame)))
    return batch, out
