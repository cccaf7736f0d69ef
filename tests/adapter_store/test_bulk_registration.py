"""Bulk registration by server path, as the benchmarks do it: many names at once, most of them hard links to
a few distinct adapters. Every registration is sent before any answer is read, so the store works on them
side by side; each content is checked and stored once, every name is served, a shared blob lives as long
as one of its names, a bad adapter fails alone, and lookups and pins are answered meanwhile."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_st, save as save_st

from services.adapter_store.blobs import unpack_pair
from services.adapter_store.client import ArenaAdapters
from services.gpu_worker.adapter_layout import pack_adapter
from shared.adapter_format import load_adapter
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.wire import (
    AcquireAdapter, AdapterCard, AdapterList, AdapterRegistered, DeleteAdapter, GetAdapter, ListAdapters, Ping, Pong,
    RegisterAdapter, ReleaseAdapter, StoreError, decode,
)

CONFIG, MODEL = "adapter_config.json", "adapter_model.safetensors"
RANKS = [8, 4, 16]


@pytest.fixture
def distinct(allowed_root, tiny_model_dir) -> list[Path]:
    """Three distinct adapters (ranks 8, 4, 16) under the allowed root."""
    return make_adapters(allowed_root / "sets", tiny_model_dir, len(RANKS), ranks=RANKS, seed=3)


def linked(allowed_root: Path, source: Path, name: str) -> Path:
    """A folder whose two files are hard links to another adapter's (the benchmark populations' way)."""
    folder = allowed_root / name
    folder.mkdir()
    for fname in (CONFIG, MODEL):
        os.link(source / fname, folder / fname)
    return folder


def send_all(client, msgs: dict[str, RegisterAdapter]) -> None:
    """Send every registration before reading any answer; each answer comes back under its key."""
    for key, msg in msgs.items():
        msg.call_id = key
        client.send(msg)


def collect(client, keys, timeout_s: float = 60.0) -> dict:
    replies: dict = {}
    deadline = time.monotonic() + timeout_s
    while set(replies) < set(keys):
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and client.socket.poll(left_ms), f"no answer for {sorted(set(keys) - set(replies))}"
        reply = decode(client.socket.recv_multipart())
        replies[reply.call_id] = reply
    return replies


def register_all(client, folders: dict[str, Path]) -> dict:
    send_all(client, {name: RegisterAdapter(name, path=str(folder)) for name, folder in folders.items()})
    return collect(client, folders)


def blob_sha256s(store) -> list[str]:
    return sorted(p.name for p in (store.data_dir / "blobs").iterdir())


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stopped_log(store) -> str:
    """The store's whole log: stopped first, since a process flushes its output only as it exits."""
    store.stop()
    return store.log_path.read_text(errors="replace")


def checked_on_registration(store) -> int:
    """Registrations whose content checks ran (the others found their content checked before)."""
    return len(re.findall(r"adapter_registered .*checked=True", stopped_log(store)))


def test_a_bulk_of_shared_contents_stores_each_content_once_and_serves_every_name(
        store, store_client, allowed_root, distinct, tiny_model_dir):
    folders = {f"bulk-{i:02d}": linked(allowed_root, distinct[i % 3], f"bulk-{i:02d}") for i in range(24)}
    replies = register_all(store_client, folders)

    assert all(isinstance(r, AdapterRegistered) and r.created for r in replies.values()), replies
    cards = {name: r.card for name, r in replies.items()}
    # One blob per distinct content, named by the sha256 of its own bytes, holding that adapter's files.
    assert len(blob_sha256s(store)) == 3
    for name, card in cards.items():
        source = distinct[int(name[-2:]) % 3]
        blob = store.data_dir / "blobs" / card.sha256
        assert file_sha256(blob) == card.sha256
        config_json, model_st = unpack_pair(blob.read_bytes())
        assert json.loads(config_json) == json.loads((source / CONFIG).read_bytes())
        assert model_st == (source / MODEL).read_bytes()
        assert card.rank == RANKS[int(name[-2:]) % 3]

    listed = store_client.call(ListAdapters())
    assert isinstance(listed, AdapterList) and sorted(c.name for c in listed.cards) == sorted(folders)
    # Every name is served: its rows in the arena are its adapter's, packed for the engine.
    cfg = ModelConfig.from_dir(tiny_model_dir)
    expected = [pack_adapter(load_adapter(d, cfg), cfg, cfg.kv_dim, torch.float32).rows for d in distinct]
    reader = ArenaAdapters(store_client, "worker-0")
    for name, card in cards.items():
        assert torch.equal(reader.load_copy(card.id).rows, expected[int(name[-2:]) % 3]), name
    reader.close()
    # The content checks ran once per distinct content, not once per name.
    assert checked_on_registration(store) == 3


def test_a_shared_blob_outlives_all_but_the_last_of_its_names(
        store_factory, redis_server, allowed_root, distinct, tiny_model_dir):
    store = store_factory()
    client = store.client()
    folders = {name: linked(allowed_root, distinct[0], name) for name in ("first", "second", "third")}
    folders["other"] = distinct[1]
    cards = {name: r.card for name, r in register_all(client, folders).items()}
    shared = cards["first"].sha256
    assert cards["second"].sha256 == cards["third"].sha256 == shared != cards["other"].sha256

    client.call(DeleteAdapter("first"))
    assert shared in blob_sha256s(store)
    # The startup reconciler also keeps a blob that some name still uses.
    client.close()
    store.stop()
    store = store_factory()
    client = store.client()
    assert sorted(blob_sha256s(store)) == sorted([shared, cards["other"].sha256])
    cfg = ModelConfig.from_dir(tiny_model_dir)
    expected = pack_adapter(load_adapter(distinct[0], cfg), cfg, cfg.kv_dim, torch.float32).rows
    reader = ArenaAdapters(client, "worker-0")
    assert torch.equal(reader.load_copy(cards["second"].id).rows, expected)

    client.call(DeleteAdapter("second"))
    assert shared in blob_sha256s(store)
    client.call(DeleteAdapter("third"))
    assert blob_sha256s(store) == [cards["other"].sha256]
    assert not redis_server.client().exists(f"loraplex:blob:{shared}")

    # The same content under a new name: known to this store (its checks passed under this model), so
    # not checked again, but its blob is gone and is written again from the bytes just read.
    again = client.call(RegisterAdapter("fourth", path=str(linked(allowed_root, distinct[0], "fourth")))).card
    assert again.sha256 == shared and file_sha256(store.data_dir / "blobs" / shared) == shared
    assert torch.equal(reader.load_copy(again.id).rows, expected)
    reader.close()
    client.close()
    assert re.search(r"adapter_registered .*adapter=fourth@\S+ .*blob_written=True .*checked=False", stopped_log(store))


def test_a_known_content_under_a_new_name_is_hashed_not_copied(store, store_client, allowed_root, distinct):
    first = store_client.call(RegisterAdapter("one", path=str(distinct[0]))).card
    second = store_client.call(RegisterAdapter("two", path=str(linked(allowed_root, distinct[0], "two")))).card
    other = store_client.call(RegisterAdapter("three", path=str(distinct[1]))).card
    assert second.sha256 == first.sha256 != other.sha256
    assert second.bytes == first.bytes and second.rank == first.rank == RANKS[0]
    log = stopped_log(store)
    assert re.search(r"adapter_registered .*adapter=one@\S+ .*checked=True hashed_only=False", log)
    assert re.search(r"adapter_registered .*adapter=two@\S+ .*checked=False hashed_only=True", log)
    assert re.search(r"adapter_registered .*adapter=three@\S+ .*checked=True hashed_only=False", log)


def test_holding_a_missing_blob_without_its_bytes_asks_for_them(tmp_path):
    from services.adapter_store.blobs import BlobStore
    from services.adapter_store.contents import BlobGone, ContentTable

    contents = ContentTable(BlobStore(tmp_path), "fp", lambda sha: 0)
    with pytest.raises(BlobGone):
        contents.hold("ab" * 32, b"{}", None)
    assert contents.delete_blob("ab" * 32)  # no hold was left behind


def test_a_bad_adapter_in_a_bulk_registration_fails_alone_with_its_reason(store, store_client, allowed_root, distinct):
    folders = {f"good-{i:02d}": linked(allowed_root, distinct[i % 3], f"good-{i:02d}") for i in range(12)}
    # Non-finite weights, twice (two names of one bad content, checked at the same time).
    tensors = load_st((distinct[0] / MODEL).read_bytes())
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("inf")
    bad = allowed_root / "bad-source"
    bad.mkdir()
    (bad / CONFIG).write_bytes((distinct[0] / CONFIG).read_bytes())
    (bad / MODEL).write_bytes(save_st(tensors))
    folders["broken-1"] = linked(allowed_root, bad, "broken-1")
    folders["broken-2"] = linked(allowed_root, bad, "broken-2")
    # A FIFO where the weights should be: refused at once, never waited on.
    fifo = allowed_root / "fifo"
    fifo.mkdir()
    (fifo / CONFIG).write_bytes((distinct[1] / CONFIG).read_bytes())
    os.mkfifo(fifo / MODEL)
    folders["fifo"] = fifo
    names = list(folders)
    folders = {name: folders[name] for name in names[6:] + names[:6]}  # the bad ones mid-bulk

    replies = register_all(store_client, folders)

    for name in ("broken-1", "broken-2"):
        err = replies[name]
        assert isinstance(err, StoreError) and (err.status, err.code) == (400, "invalid_adapter")
        assert key in err.message and "non-finite" in err.message
    assert isinstance(replies["fifo"], StoreError) and replies["fifo"].status == 400
    assert "adapter_model.safetensors is not a regular file" in replies["fifo"].message
    good = {n: r for n, r in replies.items() if n.startswith("good-")}
    assert all(isinstance(r, AdapterRegistered) and r.created for r in good.values())
    # Nothing of the bad ones is stored.
    assert sorted(blob_sha256s(store)) == sorted({r.card.sha256 for r in good.values()})
    assert sorted(c.name for c in store_client.call(ListAdapters()).cards) == sorted(good)


def test_lookups_and_pins_are_answered_while_registrations_wait_on_the_registry(
        store, store_client, redis_server, allowed_root, distinct):
    steady = store_client.call(RegisterAdapter("steady", path=str(distinct[0]))).card
    folders = {f"queued-{i}": linked(allowed_root, distinct[i % 3], f"queued-{i}") for i in range(10)}
    bulk = store.client()
    redis = redis_server.client()
    # Redis holds every write (a registration's entry) and still answers reads (lookups).
    redis.client_pause(9_000, all=False)
    try:
        send_all(bulk, {name: RegisterAdapter(name, path=str(folder)) for name, folder in folders.items()})
        assert isinstance(store_client.call(GetAdapter("steady"), timeout_s=5), AdapterCard)
        assert [c.name for c in store_client.call(ListAdapters(), timeout_s=5).cards] == ["steady"]
        loc = store_client.call(AcquireAdapter(steady.id, "worker-0"), timeout_s=5)
        assert loc.adapter == steady.id
        store_client.call(ReleaseAdapter(steady.id, "worker-0"), timeout_s=5)
        assert isinstance(store_client.call(Ping(), timeout_s=5), Pong)
        assert not bulk.socket.poll(0)  # no registration could finish: their entries wait on Redis
    finally:
        redis.client_unpause()
    replies = collect(bulk, folders)
    assert all(isinstance(r, AdapterRegistered) and r.created for r in replies.values()), replies
    assert len(store_client.call(ListAdapters()).cards) == 11
    bulk.close()
