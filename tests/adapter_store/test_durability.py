"""Crashes and restarts: registrations survive redis-server SIGKILL, orphans are reconciled at startup,
deletions wait for pins, the arena is warmed again from the blob store and never leaks a segment."""
from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from services.adapter_store.blobs import BlobStore
from services.adapter_store.client import StoreCallError
from services.adapter_store.registry import Registry, RegistryNotDurable
from shared.wire import (
    AcquireAdapter, DeleteAdapter, GetAdapter, ListAdapters, RegisterAdapter, ReleaseAdapter, ReleaseWorker,
    Ping, WarmAdapters,
)

from .conftest import RedisServer, adapter_files


def register(client, folder, name, tenant=""):
    config_json, model_st = adapter_files(folder)
    return client.call(RegisterAdapter(name, tenant, config_json=config_json, model_safetensors=model_st)).card


def registered_then_restarted(store_factory, named_folders: list, **flags):
    """Cards of adapters registered with one store process, and a fresh process of the same store (its arena
    empty: acquires read the blobs from disk), started with `flags`."""
    first = store_factory()
    client = first.client()
    cards = [register(client, folder, name) for name, folder in named_folders]
    client.close()
    first.stop()
    return cards, store_factory(**flags)


def file_sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resident(client) -> dict[str, bool]:
    return {c.name: c.host_resident for c in client.call(ListAdapters()).cards}


def test_a_registration_that_returned_survives_redis_sigkill(store, store_client, redis_server, tiny_adapter_dirs):
    card = register(store_client, tiny_adapter_dirs[2], "durable")
    redis_server.kill()  # no shutdown, no final fsync: only what was fsync'd before the reply counts
    redis_server.start()
    after = Registry(redis_server.url).by_id(card.id)
    assert after is not None and after.sha256 == card.sha256 and after.status == "ready"
    assert file_sha256(store.data_dir / "blobs" / card.sha256) == card.sha256
    # The running store reconnects and serves it.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert store_client.call(GetAdapter("durable")).id == card.id
            break
        except StoreCallError:
            if time.monotonic() > deadline:
                raise


def test_the_store_refuses_a_redis_that_could_lose_registrations(tmp_path):
    lax = RedisServer(tmp_path / "lax", appendfsync="everysec")
    lax.start()
    try:
        with pytest.raises(RegistryNotDurable, match="appendfsync always"):
            Registry(lax.url).check_durable()
    finally:
        lax.stop()


def test_orphan_blobs_and_temp_files_are_removed_at_startup(store_factory, tiny_adapter_dirs):
    store = store_factory()
    client = store.client()
    kept = register(client, tiny_adapter_dirs[0], "kept")
    client.close()
    store.stop()
    # What a crash between the blob write and the registry write leaves behind:
    orphan = BlobStore(store.data_dir).put(*adapter_files(tiny_adapter_dirs[1]))
    (store.data_dir / "blobs" / f"{orphan}.123.tmp").write_bytes(b"torn")
    assert len(list((store.data_dir / "blobs").iterdir())) == 3

    store = store_factory()
    assert sorted(p.name for p in (store.data_dir / "blobs").iterdir()) == [kept.sha256]
    client = store.client()
    assert client.call(GetAdapter("kept")).sha256 == kept.sha256
    client.close()


def test_delete_lets_pinned_users_finish_then_drops_entry_and_unshared_blob(store, store_client, redis_server, tiny_adapter_dirs):
    card = register(store_client, tiny_adapter_dirs[1], "busy")
    twin = register(store_client, tiny_adapter_dirs[1], "busy-twin")  # same content, same blob
    assert twin.sha256 == card.sha256 and twin.id != card.id
    store_client.call(AcquireAdapter(card.id, "worker-0"))
    store_client.call(DeleteAdapter("busy"))
    with pytest.raises(StoreCallError):
        store_client.call(GetAdapter("busy"))  # new requests: 404 at once
    # A request already admitted can still pin it.
    store_client.call(AcquireAdapter(card.id, "worker-1"))
    redis = redis_server.client()
    assert redis.hget(f"loraplex:adapter:{card.id}", "status") == b"deleting"
    store_client.call(ReleaseAdapter(card.id, "worker-0"))
    assert redis.exists(f"loraplex:adapter:{card.id}")
    store_client.call(ReleaseAdapter(card.id, "worker-1"))
    assert not redis.exists(f"loraplex:adapter:{card.id}")
    with pytest.raises(StoreCallError) as err:
        store_client.call(AcquireAdapter(card.id, "worker-0"))
    assert err.value.error.status == 404
    assert (store.data_dir / "blobs" / card.sha256).exists()  # busy-twin still uses it
    store_client.call(DeleteAdapter("busy-twin"))
    assert not (store.data_dir / "blobs" / card.sha256).exists()
    assert redis.keys("loraplex:adapter:*") == [] and redis.keys("loraplex:blob:*") == []


def test_a_dead_workers_pins_are_released_and_pending_deletes_finish(store, store_client, redis_server, tiny_adapter_dirs):
    card = register(store_client, tiny_adapter_dirs[0], "held")
    store_client.call(AcquireAdapter(card.id, "worker-7"))
    store_client.call(AcquireAdapter(card.id, "worker-7"))
    store_client.call(DeleteAdapter("held"))
    assert (store.data_dir / "blobs" / card.sha256).exists()
    store_client.call(ReleaseWorker("worker-7"))
    assert not (store.data_dir / "blobs" / card.sha256).exists()
    assert not redis_server.client().exists(f"loraplex:adapter:{card.id}")


def test_a_delete_pending_at_a_crash_completes_on_restart(store_factory, redis_server, tiny_adapter_dirs):
    store = store_factory()
    client = store.client()
    card = register(client, tiny_adapter_dirs[3], "doomed")
    client.call(AcquireAdapter(card.id, "worker-0"))
    client.call(DeleteAdapter("doomed"))
    client.close()
    store.stop(signal.SIGKILL)
    assert (store.data_dir / "blobs" / card.sha256).exists()
    store_factory()
    assert not (store.data_dir / "blobs" / card.sha256).exists()
    assert not redis_server.client().exists(f"loraplex:adapter:{card.id}")


def test_after_a_restart_the_arena_is_warmed_from_the_blob_store_on_hints(store_factory, tiny_adapter_dirs):
    store = store_factory()
    client = store.client()
    cards = {name: register(client, folder, name) for name, folder in zip("abc", tiny_adapter_dirs)}
    assert resident(client) == {"a": True, "b": True, "c": True}
    client.close()
    store.stop()

    store = store_factory()
    client = store.client()
    assert resident(client) == {"a": False, "b": False, "c": False}
    client.call(WarmAdapters([cards["b"].id, cards["a"].id]))
    assert resident(client) == {"a": True, "b": True, "c": False}
    # Fire and forget: loaded while the store is idle.
    client.send(WarmAdapters([cards["c"].id]))
    deadline = time.monotonic() + 10
    while not resident(client)["c"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.close()


def test_an_adapter_larger_than_the_arena_registers_but_cannot_be_acquired(store_factory, tiny_adapter_dirs):
    # rank 32 on every module of the tiny model packs to 360 KiB; rank 4 to 45 KiB.
    store = store_factory(arena_bytes=256 * 1024)
    client = store.client()
    wide = register(client, tiny_adapter_dirs[3], "wide")
    narrow = register(client, tiny_adapter_dirs[2], "narrow")
    assert not wide.host_resident and narrow.host_resident
    with pytest.raises(StoreCallError) as err:
        client.call(AcquireAdapter(wide.id, "worker-0"))
    assert (err.value.error.status, err.value.error.code) == (507, "arena_too_small")
    assert client.call(AcquireAdapter(narrow.id, "worker-0")).nbytes == 2 * 2 * 11 * 4 * 64 * 4
    client.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_arena_segment_never_outlives_the_store(store_factory, sig):
    store = store_factory()
    assert os.path.exists(f"/dev/shm/{store.arena_name}")
    code = store.stop(sig)
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    # After SIGKILL the store's resource tracker notices and unlinks it.
    deadline = time.monotonic() + 10
    while os.path.exists(f"/dev/shm/{store.arena_name}"):
        assert time.monotonic() < deadline, "arena segment leaked"
        time.sleep(0.05)


def test_acquires_from_disk_at_once_share_one_arena_copy_and_the_store_keeps_answering(store_factory, tiny_adapter_dirs):
    """After a restart the arena is empty: acquires read the blob on the load threads. Two workers asking for
    the same adapter at once get the same rows; a ping sent behind them is answered too."""
    import zmq

    from shared.wire import AdapterLocation, Ping, Pong, decode, encode

    cards, store = registered_then_restarted(
        store_factory, [(f"cold-{i}", folder) for i, folder in enumerate(tiny_adapter_dirs[:3])])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(store.address)
    try:
        asks = [AcquireAdapter(c.id, f"worker-{w}", call_id=f"{c.id}/{w}") for c in cards for w in (0, 1)]
        for msg in asks:
            sock.send_multipart(encode(msg))
        sock.send_multipart(encode(Ping(call_id="ping")))
        replies = {}
        while len(replies) < len(asks) + 1:
            assert sock.poll(20_000), f"no reply; got {sorted(replies)}"
            reply = decode(sock.recv_multipart())
            replies[reply.call_id] = reply
        for c in cards:
            a, b = replies[f"{c.id}/0"], replies[f"{c.id}/1"]
            assert isinstance(a, AdapterLocation) and isinstance(b, AdapterLocation)
            assert (a.offset, a.nbytes) == (b.offset, b.nbytes)
        assert len({replies[f"{c.id}/0"].offset for c in cards}) == len(cards)
        sock.send_multipart(encode(Ping(call_id="after")))
        assert sock.poll(20_000)
        pong = decode(sock.recv_multipart())
        assert isinstance(pong, Pong) and (pong.arena_adapters, pong.arena_pins) == (len(cards), 2 * len(cards))
        assert pong.arena_name and pong.arena_name == store.arena_name
        # Asked twice at once, each was read from disk once: the second acquire joined the first's read.
        assert (pong.blob_reads, pong.arena_loads) == (len(cards), len(cards))
    finally:
        sock.close(0)
        ctx.term()


def test_a_hint_and_an_acquire_of_one_cold_adapter_read_it_once(store_factory, tiny_adapter_dirs):
    # Whichever comes first (the hinted load runs when the store is idle), the blob is read once.
    (card,), store = registered_then_restarted(store_factory, [("cold", tiny_adapter_dirs[0])])
    client = store.client()
    try:
        client.send(WarmAdapters([card.id]))
        loc = client.call(AcquireAdapter(card.id, "worker-0"))
        assert loc.nbytes > 0
        pong = client.call(Ping())
        assert (pong.blob_reads, pong.arena_loads, pong.arena_pins) == (1, 1, 1)
    finally:
        client.close()


def test_an_adapter_that_cannot_fit_beside_the_pinned_ones_is_refused_without_reading_it(store_factory,
                                                                                         tiny_adapter_dirs):
    # An arena with room for one wide adapter: while a worker holds it, another wide one is refused at
    # once (the worker asks again later) instead of being read from disk only to be refused.
    cards, store = registered_then_restarted(  # ranks 16 and 32
        store_factory, [(f"wide-{i}", folder) for i, folder in enumerate(tiny_adapter_dirs[1:4:2])],
        arena_bytes=3 * 2**17)
    client = store.client()
    try:
        client.call(AcquireAdapter(cards[1].id, "worker-0"))
        with pytest.raises(StoreCallError) as refused:
            client.call(AcquireAdapter(cards[0].id, "worker-1"))
        assert (refused.value.error.status, refused.value.error.code) == (507, "arena_full")
        assert client.call(Ping()).blob_reads == 1
        client.call(ReleaseAdapter(cards[1].id, "worker-0", call_id="r"))
        assert client.call(AcquireAdapter(cards[0].id, "worker-1")).nbytes > 0  # room again: read and laid in
        assert client.call(Ping()).blob_reads == 2
    finally:
        client.close()


def test_acquires_beyond_the_load_threads_wait_their_turn_and_are_all_answered(store_factory, tiny_adapter_dirs):
    # One load thread: four cold adapters asked for at once, twice each, are read one after another, each
    # once, and every acquire gets its adapter.
    import zmq

    from shared.wire import AdapterLocation, decode, encode

    cards, store = registered_then_restarted(
        store_factory, [(f"queued-{i}", folder) for i, folder in enumerate(tiny_adapter_dirs)], load_threads=1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(store.address)
    try:
        asks = [AcquireAdapter(c.id, f"worker-{w}", call_id=f"{c.id}/{w}") for w in (0, 1) for c in cards]
        for msg in asks:
            sock.send_multipart(encode(msg))
        replies = {}
        while len(replies) < len(asks):
            assert sock.poll(20_000), f"no reply; got {sorted(replies)}"
            reply = decode(sock.recv_multipart())
            replies[reply.call_id] = reply
        assert all(isinstance(r, AdapterLocation) for r in replies.values()), replies
        for c in cards:
            assert replies[f"{c.id}/0"].offset == replies[f"{c.id}/1"].offset
        sock.send_multipart(encode(Ping(call_id="after")))
        assert sock.poll(20_000)
        pong = decode(sock.recv_multipart())
        assert (pong.blob_reads, pong.arena_adapters, pong.arena_pins) == (len(cards), len(cards), 2 * len(cards))
    finally:
        sock.close(0)
        ctx.term()
