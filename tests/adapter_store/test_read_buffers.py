"""Load threads read blob after blob into one reused buffer each; every load is still exact."""
from __future__ import annotations

import threading

import torch

from services.adapter_store.read_buffers import GROWTH, ReadBuffers
from services.gpu_worker.adapter_layout import pack_adapter
from shared.adapter_format import load_adapter
from shared.model_config import ModelConfig
from shared.wire import AcquireAdapter, ReleaseAdapter

from .conftest import arena_rows
from .test_durability import registered_then_restarted


def test_a_thread_reuses_its_buffer_and_grows_it_only_for_a_larger_read():
    buffers = ReadBuffers()
    first = buffers.get(1000)
    assert len(first) == 1000 and buffers.held_bytes() == GROWTH
    first[:4] = b"abcd"
    smaller = buffers.get(10)
    assert bytes(smaller[:4]) == b"abcd", "a smaller read lands in the same memory"
    larger = buffers.get(GROWTH + 1)
    assert len(larger) == GROWTH + 1 and buffers.held_bytes() == 2 * GROWTH
    others: list[int] = []
    worker = threading.Thread(target=lambda: others.append(ReadBuffers.held_bytes(buffers)))
    worker.start()
    worker.join()
    assert others == [0], "another thread has a buffer of its own"


def test_adapters_read_one_after_another_by_one_load_thread_each_load_exactly(
        store_factory, tiny_model_dir, tmp_path):
    # Ranks large, small, large: the second read fills only part of the buffer the first left behind, the
    # third overwrites it again; every adapter's rows must be those of its own files, and rows laid into the
    # arena earlier must not change when the buffer is reused.
    from shared.make_adapters import make_adapters

    folders = make_adapters(tmp_path / "mixed", tiny_model_dir, 3, ranks=[16, 2, 8], seed=11)
    cards, store = registered_then_restarted(store_factory, [(f"m{i}", f) for i, f in enumerate(folders)],
                                             dtype="bfloat16", load_threads=1)
    cfg = ModelConfig.from_dir(tiny_model_dir)
    client = store.client()
    try:
        wants = [pack_adapter(load_adapter(f, cfg), cfg, cfg.kv_dim, torch.bfloat16).rows for f in folders]
        locs = []
        for card, want in zip(cards, wants):
            loc = client.call(AcquireAdapter(card.id, "worker-0"))
            assert torch.equal(arena_rows(loc), want)
            locs.append(loc)
        for loc, want in zip(locs, wants):
            assert torch.equal(arena_rows(loc), want), "rows in the arena are copies, not views of the buffer"
        for card in cards:
            client.call(ReleaseAdapter(card.id, "worker-0", call_id=f"r-{card.id}"))
    finally:
        client.close()
        store.stop()
