"""The Redis registry on a real redis-server: one script per change, so a crash mid-write leaves nothing."""
from __future__ import annotations

import time

from services.adapter_store.registry import Registry
from shared.wire import AdapterCard, adapter_id


def card(name: str, sha: str, tenant: str = "") -> AdapterCard:
    return AdapterCard(id=adapter_id(tenant, name, sha), name=name, tenant=tenant, rank=8, target_modules=["q_proj"],
                       sha256=sha, bytes=100, created=time.time(), status="ready")


def test_register_is_idempotent_for_same_content_and_conflicts_otherwise(redis_server):
    reg = Registry(redis_server.url)
    first = reg.register(card("a", "1" * 64))
    assert first.outcome == "created" and first.card.status == "ready"
    assert reg.register(card("a", "1" * 64)).outcome == "exists"
    conflict = reg.register(card("a", "2" * 64))
    assert conflict.outcome == "conflict" and conflict.card.sha256 == "1" * 64
    assert reg.lookup("", "a").sha256 == "1" * 64
    assert reg.referenced_blobs() == {"1" * 64}


def test_delete_is_two_phase_and_blob_references_are_counted(redis_server):
    reg = Registry(redis_server.url)
    a, b = card("a", "3" * 64), card("b", "3" * 64)
    reg.register(a)
    reg.register(b)
    assert reg.purge(a.id) == -1  # not deleting: purge refuses
    assert reg.mark_deleted("", "a") == a.id
    assert reg.lookup("", "a") is None and reg.by_id(a.id).status == "deleting"
    assert reg.deleting_ids() == [a.id]
    assert reg.purge(a.id) == 1  # b still uses the blob
    assert reg.mark_deleted("", "b") == b.id and reg.purge(b.id) == 0
    assert reg.referenced_blobs() == set()
    assert reg.mark_deleted("", "b") is None


def test_reregistering_same_content_while_a_delete_waits_revives_the_entry(redis_server):
    reg = Registry(redis_server.url)
    a = card("a", "4" * 64)
    reg.register(a)
    reg.mark_deleted("", "a")
    assert reg.register(card("a", "4" * 64)).outcome == "created"
    assert reg.by_id(a.id).status == "ready"
    assert reg.purge(a.id) == -1  # the pending purge must not remove the revived entry


def test_a_crash_in_the_middle_of_a_registration_write_leaves_no_partial_entry(redis_server):
    reg = Registry(redis_server.url)
    reg.register(card("kept", "5" * 64))
    reg.register(card("cut", "6" * 64))
    redis_server.kill()
    aof = redis_server.dir / "appendonly.aof"
    data = aof.read_bytes()
    last_exec = data.rindex(b"EXEC")
    assert data.rfind(b"MULTI", 0, last_exec) > data.rfind(b"EXEC", 0, last_exec), "registration is one transaction"
    # Cut the file inside the last transaction: its first writes are on disk, its EXEC is not.
    aof.write_bytes(data[: last_exec - 20])
    redis_server.start()
    reg = Registry(redis_server.url)
    assert reg.lookup("", "kept") is not None
    assert reg.lookup("", "cut") is None
    r = redis_server.client()
    assert r.keys("loraplex:*6666*") == [] and r.hget("loraplex:names:", "cut") is None
