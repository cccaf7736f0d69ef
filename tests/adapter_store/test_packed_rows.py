"""Contents' rows kept on disk in the arena's layout: a later load from disk is one read of them, exact,
and a damaged or stale file never serves a load."""
from __future__ import annotations

import torch

from services.adapter_store.contents import check_fingerprint
from services.adapter_store.packed_rows import PackedRows
from services.gpu_worker.adapter_layout import pack_adapter
from shared.adapter_format import load_adapter
from shared.model_config import ModelConfig
from shared.wire import AcquireAdapter, DeleteAdapter, Ping, ReleaseAdapter

from .conftest import arena_rows
from .test_durability import register


def packed_files(store) -> list:
    return sorted(p for p in (store.data_dir / "packed").rglob("*") if p.is_file())


def registered(store_factory, folder, **flags):
    """The card of `folder` registered as "a" with a store started with `flags`, and that store."""
    store = store_factory(dtype="bfloat16", **flags)
    client = store.client()
    try:
        return register(client, folder, "a"), store
    finally:
        client.close()


def acquire_rows(store, card) -> tuple[torch.Tensor, int]:
    """The rows a worker gets for `card`, and the store's packed_reads afterwards."""
    client = store.client()
    try:
        loc = client.call(AcquireAdapter(card.id, "worker-0"))
        rows = arena_rows(loc)
        client.call(ReleaseAdapter(card.id, "worker-0", call_id="r"))
        return rows, client.call(Ping()).packed_reads
    finally:
        client.close()


def restarted(store, store_factory, **flags):
    """A fresh process of the same store (empty arena: every acquire comes from disk)."""
    store.stop()
    return store_factory(dtype="bfloat16", **flags)


def want_rows(tiny_model_dir, folder) -> torch.Tensor:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    return pack_adapter(load_adapter(folder, cfg), cfg, cfg.kv_dim, torch.bfloat16).rows


def test_a_registered_content_loads_from_disk_as_one_read_of_its_packed_rows(
        store_factory, tiny_model_dir, tiny_adapter_dirs):
    card, store = registered(store_factory, tiny_adapter_dirs[0], packed_rows_min_free_gb=0)
    (written,) = packed_files(store)
    assert written.name == card.sha256, "registration writes the content's rows"
    store = restarted(store, store_factory, packed_rows_min_free_gb=0)
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want_rows(tiny_model_dir, tiny_adapter_dirs[0])) and packed_reads == 1
    store.stop()


def test_a_content_stored_without_packed_rows_gets_them_at_its_first_load(
        store_factory, tiny_model_dir, tiny_adapter_dirs):
    card, store = registered(store_factory, tiny_adapter_dirs[1], packed_rows=False)
    assert packed_files(store) == []
    store = restarted(store, store_factory, packed_rows_min_free_gb=0)
    want = want_rows(tiny_model_dir, tiny_adapter_dirs[1])
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want) and packed_reads == 0, "the first load packs the blob"
    assert [p.name for p in packed_files(store)] == [card.sha256]
    store = restarted(store, store_factory, packed_rows_min_free_gb=0)
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want) and packed_reads == 1, "the next one reads the packed rows"
    store.stop()


def test_a_damaged_packed_file_is_passed_over_and_written_again(store_factory, tiny_model_dir, tiny_adapter_dirs):
    card, store = registered(store_factory, tiny_adapter_dirs[1], packed_rows_min_free_gb=0)
    store.stop()
    (written,) = packed_files(store)
    whole = written.read_bytes()
    written.write_bytes(whole[:-5])  # torn by a crash
    store = restarted(store, store_factory, packed_rows_min_free_gb=0)
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want_rows(tiny_model_dir, tiny_adapter_dirs[1])) and packed_reads == 0
    assert written.read_bytes() == whole, "rebuilt from the blob"
    store.stop()


def test_deleting_the_last_name_of_a_content_deletes_its_packed_rows(store_factory, tiny_adapter_dirs):
    card, store = registered(store_factory, tiny_adapter_dirs[2], packed_rows_min_free_gb=0)
    assert len(packed_files(store)) == 1
    client = store.client()
    try:
        client.call(DeleteAdapter("a"))
    finally:
        client.close()
    assert packed_files(store) == []
    store.stop()


def test_packed_rows_turned_off_are_dropped_and_loads_read_the_blob(store_factory, tiny_model_dir, tiny_adapter_dirs):
    card, store = registered(store_factory, tiny_adapter_dirs[0], packed_rows_min_free_gb=0)
    assert len(packed_files(store)) == 1
    store = restarted(store, store_factory, packed_rows=False)
    assert not (store.data_dir / "packed").exists(), "their disk space comes back"
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want_rows(tiny_model_dir, tiny_adapter_dirs[0])) and packed_reads == 0
    assert not (store.data_dir / "packed").exists()
    store.stop()


def test_no_packed_rows_are_written_into_the_disk_reserve(store_factory, tiny_model_dir, tiny_adapter_dirs):
    # A reserve larger than any disk: registrations and loads still work, from the blob each time.
    card, store = registered(store_factory, tiny_adapter_dirs[0], packed_rows_min_free_gb=1e9)
    store = restarted(store, store_factory, packed_rows_min_free_gb=1e9)
    rows, packed_reads = acquire_rows(store, card)
    assert torch.equal(rows, want_rows(tiny_model_dir, tiny_adapter_dirs[0]))
    assert packed_reads == 0 and packed_files(store) == []
    store.stop()


def test_startup_keeps_only_the_current_layout_and_stored_contents(tmp_path, tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    fingerprint = check_fingerprint(cfg, 256)
    old = PackedRows(tmp_path, torch.float32, cfg.kv_dim, fingerprint)
    current = PackedRows(tmp_path, torch.bfloat16, cfg.kv_dim, fingerprint)
    assert old.root != current.root, "another row dtype is another folder"
    kept, gone = "a" * 64, "b" * 64
    for sha in (kept, gone):
        current.path(sha).write_bytes(b"x")
    (current.root / f"{kept}.1-2.tmp").write_bytes(b"x")
    old.path(kept).write_bytes(b"x")
    assert current.keep_only({kept}) == 3  # the other folder, the unstored content, the temp file
    assert [p.name for p in current.root.iterdir()] == [kept] and not old.root.exists()
    assert current.read(kept, "a") is None, "a file that is not packed rows serves nothing"
    assert not current.path(kept).exists(), "and is dropped"


def test_packed_rows_read_back_exactly_and_a_file_of_another_layout_serves_nothing(tmp_path, tiny_model_dir,
                                                                                   tiny_adapter_dirs):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    rows = PackedRows(tmp_path, torch.bfloat16, cfg.kv_dim, check_fingerprint(cfg, 256))
    packed = pack_adapter(load_adapter(tiny_adapter_dirs[0], cfg), cfg, cfg.kv_dim, torch.bfloat16)
    sha = "c" * 64
    rows.write(sha, packed)
    arena_range = torch.zeros(packed.rows.numel() * 2, dtype=torch.uint8)
    read, in_place = rows.read(sha, "a", arena_range)
    assert in_place and torch.equal(read.rows, packed.rows)
    assert (read.ranks, read.a_off, read.b_off) == (packed.ranks, packed.a_off, packed.b_off)
    read, in_place = rows.read(sha, "a", torch.zeros(7, dtype=torch.uint8))  # the card's estimate was off
    assert not in_place and torch.equal(read.rows, packed.rows)
    narrower = PackedRows(tmp_path, torch.bfloat16, cfg.kv_dim // 2, "x")
    narrower.path(sha).write_bytes(rows.path(sha).read_bytes())
    assert narrower.read(sha, "a") is None and not narrower.path(sha).exists()
