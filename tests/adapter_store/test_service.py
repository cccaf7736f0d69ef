"""The store as a real process behind real ZeroMQ, on a real redis-server: management calls end to end."""
from __future__ import annotations

import json

import pytest
import torch

from services.adapter_store.client import ArenaAdapters, StoreCallError
from services.gpu_worker.adapter_layout import pack_adapter
from shared.adapter_format import load_adapter
from shared.model_config import ModelConfig
from shared.wire import (
    AcquireAdapter, AdapterCard, AdapterList, AdapterLocation, AdapterRegistered, DeleteAdapter, GetAdapter,
    ListAdapters, RegisterAdapter, ReleaseAdapter, adapter_id,
)

from .conftest import adapter_files


def register(client, folder, name, tenant=""):
    config_json, model_st = adapter_files(folder)
    return client.call(RegisterAdapter(name, tenant, config_json=config_json, model_safetensors=model_st))


def refused(client, msg) -> tuple[int, str]:
    with pytest.raises(StoreCallError) as err:
        client.call(msg)
    return err.value.error.status, err.value.error.code


def test_register_list_get_delete(store_client, tiny_adapter_dirs, tiny_model_dir):
    reply = register(store_client, tiny_adapter_dirs[1], "support-bot")
    assert isinstance(reply, AdapterRegistered) and reply.created
    card = reply.card
    assert (card.name, card.rank, card.status) == ("support-bot", 16, "ready")
    assert card.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert card.id == adapter_id("", "support-bot", card.sha256)
    assert card.host_resident  # laid out in the arena at registration, ready for the first request

    register(store_client, tiny_adapter_dirs[2], "summarizer")
    listed = store_client.call(ListAdapters())
    assert isinstance(listed, AdapterList)
    assert [(c.name, c.rank) for c in listed.cards] == [("summarizer", 4), ("support-bot", 16)]

    got = store_client.call(GetAdapter("support-bot"))
    assert isinstance(got, AdapterCard) and got.id == card.id and got.sha256 == card.sha256

    store_client.call(DeleteAdapter("support-bot"))
    assert refused(store_client, GetAdapter("support-bot")) == (404, "adapter_not_found")
    assert [c.name for c in store_client.call(ListAdapters()).cards] == ["summarizer"]
    assert refused(store_client, DeleteAdapter("support-bot")) == (404, "adapter_not_found")


def test_same_content_again_is_idempotent_and_other_content_conflicts(store, store_client, tiny_adapter_dirs):
    first = register(store_client, tiny_adapter_dirs[0], "alpha")
    again = register(store_client, tiny_adapter_dirs[0], "alpha")
    assert first.created and not again.created
    assert again.card.id == first.card.id and again.card.created == first.card.created
    blobs = sorted(p.name for p in (store.data_dir / "blobs").iterdir())
    assert blobs == [first.card.sha256]

    config_json, model_st = adapter_files(tiny_adapter_dirs[0])
    # Formatting of the config alone does not change identity.
    pretty = json.dumps(json.loads(config_json), indent=7).encode()
    assert not store_client.call(RegisterAdapter("alpha", config_json=pretty, model_safetensors=model_st)).created

    assert refused(store_client, RegisterAdapter("alpha", config_json=adapter_files(tiny_adapter_dirs[1])[0],
                                                 model_safetensors=adapter_files(tiny_adapter_dirs[1])[1])) == (409, "adapter_exists")
    assert sorted(p.name for p in (store.data_dir / "blobs").iterdir()) == blobs
    assert store_client.call(GetAdapter("alpha")).id == first.card.id


def test_tenants_have_separate_namespaces_and_see_shared_adapters(store_client, tiny_adapter_dirs):
    shared = register(store_client, tiny_adapter_dirs[0], "common").card
    mine = register(store_client, tiny_adapter_dirs[1], "helper", tenant="acme").card
    theirs = register(store_client, tiny_adapter_dirs[2], "helper", tenant="globex").card
    assert len({shared.id, mine.id, theirs.id}) == 3
    assert store_client.call(GetAdapter("helper", "acme")).id == mine.id
    assert store_client.call(GetAdapter("helper", "globex")).id == theirs.id
    assert store_client.call(GetAdapter("common", "acme")).id == shared.id
    assert refused(store_client, GetAdapter("helper")) == (404, "adapter_not_found")
    assert [(c.tenant, c.name) for c in store_client.call(ListAdapters("acme")).cards] == [("", "common"), ("acme", "helper")]
    everyone = store_client.call(ListAdapters(all_tenants=True)).cards
    assert [(c.tenant, c.name) for c in everyone] == [("", "common"), ("acme", "helper"), ("globex", "helper")]
    # A tenant deletes only its own names.
    assert refused(store_client, DeleteAdapter("common", "acme")) == (404, "adapter_not_found")


def test_acquired_location_holds_the_packed_rows_for_the_engine_dtype(store_client, tiny_adapter_dirs, tiny_model_dir):
    card = register(store_client, tiny_adapter_dirs[3], "wide").card
    loc = store_client.call(AcquireAdapter(card.id, "worker-0"))
    assert isinstance(loc, AdapterLocation) and loc.dtype == "float32"
    cfg = ModelConfig.from_dir(tiny_model_dir)
    expected = pack_adapter(load_adapter(tiny_adapter_dirs[3], cfg), cfg, cfg.kv_dim, torch.float32)
    assert loc.shape == list(expected.rows.shape)
    assert (loc.ranks, loc.a_off, loc.b_off) == (list(expected.ranks), list(expected.a_off), list(expected.b_off))
    reader = ArenaAdapters(store_client, "worker-0")
    with reader.acquired(card.id) as packed:
        assert torch.equal(packed.rows, expected.rows)
    store_client.call(ReleaseAdapter(card.id, "worker-0"))
    assert refused(store_client, ReleaseAdapter(card.id, "worker-0")) == (409, "not_acquired")
    reader.close()


def test_malformed_frames_get_an_error_reply_and_the_store_keeps_serving(store, store_client):
    import zmq

    from shared.wire import Ping, Pong, StoreError, decode, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(store.address)
    try:
        for frames in ([b"NoSuchMessage", b"\x80"], [b"GetAdapter", b"\xc1"], [b"GetAdapter", b"\x81\xa4name\x07"],
                       encode(Pong("not-for-the-store"))):
            sock.send_multipart(frames)
            assert sock.poll(10_000)
            reply = decode(sock.recv_multipart())
            assert isinstance(reply, StoreError) and reply.status == 400
            assert reply.code in ("bad_message", "unsupported_message")
    finally:
        sock.close()
    pong = store_client.call(Ping())
    assert isinstance(pong, Pong) and pong.ready and pong.pid == store.proc.pid
