"""Stored adapters read back as views of one read: the same tensors the safetensors library would give,
and any layout a stored adapter cannot have is refused."""
from __future__ import annotations

import json
import struct
from multiprocessing import shared_memory

import pytest
import torch
from safetensors.torch import load, save

from services.adapter_store.arena_reader import location_rows
from services.adapter_store.blob_tensors import BlobLayoutError, stored_tensors
from services.adapter_store.client import StoreCallError
from services.gpu_worker.adapter_layout import pack_adapter
from shared.adapter_format import load_adapter
from shared.model_config import MODULES, ModelConfig
from shared.wire import AcquireAdapter, Ping, ReleaseAdapter

from .test_durability import registered_then_restarted


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"b": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a": torch.randn(7, 2, generator=g),
            "c": torch.randn(4, generator=g).to(torch.float16), "e": torch.zeros(0, 3, dtype=torch.float64)}


def test_views_equal_the_library_and_share_the_buffer():
    data = save(_tensors(), metadata={"format": "pt"})
    buf = bytearray(data)
    got = stored_tensors(memoryview(buf))
    want = load(data)
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
        assert torch.equal(got[key], want[key])
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    key = next(k for k, info in header.items() if k != "__metadata__" and info["data_offsets"][0] == 0
               and want[k].numel())
    others = {k: got[k].clone() for k in got if k != key}
    buf[8 + n] ^= 0xFF  # the first byte of the first tensor: its view sees the buffer itself, no copy was made
    assert not torch.equal(got[key], want[key])
    assert all(torch.equal(got[k], v) for k, v in others.items())


def _raw(header: dict, body: bytes) -> memoryview:
    text = json.dumps(header).encode()
    return memoryview(bytearray(struct.pack("<Q", len(text)) + text + body))


BF16_2x2 = {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("raw, problem", [
    (memoryview(bytearray(b"\x01\x00")), "shorter"),
    (memoryview(bytearray(struct.pack("<Q", 999) + b"{}")), "runs past"),
    (memoryview(bytearray(struct.pack("<Q", 2) + b"{x")), "not JSON"),
    (_raw([1], b""), "not an object"),
    (_raw({"t": {**BF16_2x2, "dtype": "I32"}}, bytes(8)), "not a float tensor"),
    (_raw({"t": {**BF16_2x2, "shape": [2, -2]}}, bytes(8)), "negative"),
    (_raw({"t": {**BF16_2x2, "data_offsets": [0, 6]}}, bytes(8)), "do not follow"),  # size != shape
    (_raw({"t": BF16_2x2, "u": {**BF16_2x2, "data_offsets": [4, 12]}}, bytes(12)), "do not follow"),  # overlap
    (_raw({"t": BF16_2x2, "u": {**BF16_2x2, "data_offsets": [10, 18]}}, bytes(18)), "do not follow"),  # gap
    (_raw({"t": {**BF16_2x2, "data_offsets": [0, 8]}}, bytes(4)), "do not follow"),  # past the data
    (_raw({"t": BF16_2x2}, bytes(10)), "after the last tensor"),
])
def test_layouts_a_stored_adapter_cannot_have_are_refused(raw, problem):
    with pytest.raises(BlobLayoutError, match=problem):
        stored_tensors(raw)


def test_an_adapter_loaded_from_its_blob_has_the_rows_of_its_files_and_a_damaged_blob_is_refused(
        store_factory, tiny_model_dir, tiny_adapter_dirs):
    cards, store = registered_then_restarted(store_factory, list(zip("ab", tiny_adapter_dirs)), dtype="bfloat16")
    client = store.client()
    cfg = ModelConfig.from_dir(tiny_model_dir)
    try:
        blob = store.data_dir / "blobs" / cards[1].sha256
        blob.write_bytes(blob.read_bytes()[:-3])  # a damaged disk: the safetensors data ends short
        with pytest.raises(StoreCallError) as refused:
            client.call(AcquireAdapter(cards[1].id, "worker-0"))
        assert (refused.value.error.status, refused.value.error.code) == (500, "blob_unreadable")

        loc = client.call(AcquireAdapter(cards[0].id, "worker-0"))  # the store goes on serving
        shm = shared_memory.SharedMemory(name=loc.segment)
        try:
            rows = location_rows(shm, loc).clone()
        finally:
            shm.close()
        want = pack_adapter(load_adapter(tiny_adapter_dirs[0], cfg), cfg, cfg.kv_dim, torch.bfloat16)
        assert torch.equal(rows, want.rows)
        client.call(ReleaseAdapter(cards[0].id, "worker-0", call_id="r"))
    finally:
        client.close()
        store.stop()


def test_an_adapter_whose_ranks_differ_by_module_loads_exactly_whatever_its_card_suggests(
        store_factory, tiny_model_dir, tmp_path):
    # The store sizes an acquire's arena range from the card (its largest rank on every targeted module);
    # a rank_pattern adapter needs less: its rows are laid in from memory instead, still exactly.
    from shared.make_adapters import make_adapters

    folder = make_adapters(tmp_path / "patterned", tiny_model_dir, 1, ranks=[8], seed=3,
                           rank_pattern={"q_proj": 2, "v_proj": 4})[0]
    (card,), store = registered_then_restarted(store_factory, [("patterned", folder)], dtype="bfloat16")
    client = store.client()
    cfg = ModelConfig.from_dir(tiny_model_dir)
    try:
        loc = client.call(AcquireAdapter(card.id, "worker-0"))
        want = pack_adapter(load_adapter(folder, cfg), cfg, cfg.kv_dim, torch.bfloat16)
        assert want.ranks != tuple(card.rank if m in card.target_modules else 0 for m in MODULES)
        shm = shared_memory.SharedMemory(name=loc.segment)
        try:
            rows = location_rows(shm, loc).clone()
        finally:
            shm.close()
        assert torch.equal(rows, want.rows) and tuple(loc.ranks) == want.ranks
        pong = client.call(Ping())
        assert (pong.arena_pinned_bytes, pong.arena_used_bytes) == (loc.nbytes, loc.nbytes)  # range given back
    finally:
        client.close()
        store.stop()
