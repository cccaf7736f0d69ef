"""The worker's adapter loader against a real adapter_store process: rows are viewed in the store's shared
memory without a copy and hold exactly the packed adapter; a pin is taken once and dropped when the engine no
longer holds the adapter (a deleted adapter's blob goes only then); a worker process that maps the arena and
exits does not take the segment with it."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import zmq

from services.gpu_worker.adapter_layout import pack_adapter
from services.gpu_worker.arena_client import AdapterUnavailable, ArenaAdapterLoader, ArenaSegments, StoreClient
from shared.adapter_format import load_adapter
from shared.model_config import ModelConfig
from shared.wire import AcquireAdapter, DeleteAdapter, RegisterAdapter
from tests.adapter_store.conftest import REPO, RedisServer, StoreProcess, adapter_files


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("arena-loader")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    proc = StoreProcess(redis_server.url, root / "data", tiny_model_dir, None)
    proc.start()
    yield proc
    proc.stop()
    redis_server.stop()


def register(store, folder, name: str) -> str:
    client = store.client()
    try:
        config, weights = adapter_files(folder)
        return client.call(RegisterAdapter(name=name, config_json=config, model_safetensors=weights)).card.id
    finally:
        client.close()


@pytest.fixture
def loader(store, tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    ctx = zmq.Context()
    segments = ArenaSegments(register_with_cuda=False)
    client = StoreClient(ctx, store.address, "loader-test", timeout_s=20)
    yield ArenaAdapterLoader(client, segments, cfg.num_layers, cfg.kv_dim)
    client.close()
    segments.close()
    ctx.term()


def test_rows_are_a_view_of_the_arena_holding_the_packed_adapter(store, loader, tiny_model_dir, tiny_adapter_dirs):
    folder = tiny_adapter_dirs[1]
    aid = register(store, folder, "view-me")
    packed = loader(aid)
    shm = next(iter(loader.segments._segments.values()))
    base = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
    assert base <= packed.rows.data_ptr() < base + shm.size  # no copy: the tensor's bytes are the arena's
    cfg = ModelConfig.from_dir(tiny_model_dir)
    expected = pack_adapter(load_adapter(folder, cfg), cfg, cfg.kv_dim, packed.rows.dtype)
    assert torch.equal(packed.rows, expected.rows)
    assert (packed.ranks, packed.a_off, packed.b_off) == (expected.ranks, expected.a_off, expected.b_off)
    assert loader(aid) is packed  # asked again while pinned: same view, no second pin
    loader.release_all()


def test_unknown_adapter_is_a_key_error(loader):
    with pytest.raises(KeyError, match="nobody"):
        loader("nobody@0000000000000000")
    assert loader.pinned == {}


def test_a_deleted_adapter_lives_until_the_engine_lets_go(store, loader, tiny_model_dir, tmp_path):
    from shared.make_adapters import make_adapters

    folder = make_adapters(tmp_path, tiny_model_dir, 1, ranks=[3], seed=77, prefix="pinned")[0]
    aid = register(store, folder, "pinned-one")
    loader(aid)
    client = store.client()
    try:
        client.call(DeleteAdapter(name="pinned-one"))
        blobs = store.data_dir / "blobs"
        held = set(os.listdir(blobs))
        assert loader.release_evicted({aid}) == []  # still resident in the engine: pin kept, blob kept
        time.sleep(0.3)
        assert set(os.listdir(blobs)) == held
        assert loader.release_evicted(set()) == [aid]  # evicted: released, and the deletion completes
        deadline = time.monotonic() + 10
        while set(os.listdir(blobs)) == held:
            assert time.monotonic() < deadline, "the deleted adapter's blob outlived its last pin"
            time.sleep(0.05)
    finally:
        client.close()


def test_a_worker_that_maps_the_arena_and_exits_leaves_it_in_place(store, tiny_adapter_dirs):
    aid = register(store, tiny_adapter_dirs[0], "survivor")
    script = textwrap.dedent(f"""
        import zmq
        from services.gpu_worker.arena_client import AdapterUnavailable, ArenaAdapterLoader, ArenaSegments, StoreClient
        ctx = zmq.Context()
        client = StoreClient(ctx, {store.address!r}, "short-lived", 20)
        loader = ArenaAdapterLoader(client, ArenaSegments(False), 2, 64)
        print(float(loader({aid!r}).rows.abs().sum()))
        loader.release_all()
        client.close()
    """)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 0
    assert os.path.exists(f"/dev/shm/{store.arena_name}"), "the arena vanished with a process that only mapped it"


def test_a_starting_worker_learns_the_arena_name_and_maps_it_once(store, loader, tiny_adapter_dirs):
    # What a CUDA worker does before it reports ready (there it also pins the segment with CUDA).
    name = loader.store.arena_name(timeout_s=10)
    assert name == store.arena_name
    loader.segments.pin_at_start(name)
    mapped = loader.segments._segments[name]
    packed = loader(register(store, tiny_adapter_dirs[0], "after-start"))
    assert loader.segments._segments == {name: mapped}  # the adapter's rows come from the segment mapped at start
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapped.buf))
    assert base <= packed.rows.data_ptr() < base + mapped.size


def test_a_silent_store_leaves_the_arena_name_empty_in_bounded_time():
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # takes the ping and never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    client = StoreClient(ctx, f"tcp://127.0.0.1:{port}", "silent-test", timeout_s=1)
    try:
        started = time.monotonic()
        assert client.arena_name(timeout_s=0.5) == ""
        assert 0.5 <= time.monotonic() - started < 3
    finally:
        client.close()
        sink.close(0)
        ctx.term()


def test_ready_starts_the_acquire_and_never_waits(store, loader, tiny_adapter_dirs):
    aid = register(store, tiny_adapter_dirs[0], "ready-me")
    assert loader.ready(aid) is False  # not in the arena yet: asked for, not waited on
    assert aid in loader.pending
    deadline = time.monotonic() + 20
    while not loader.ready(aid):
        assert time.monotonic() < deadline, "the store never answered"
        time.sleep(0.01)
    assert aid in loader.pinned and aid not in loader.pending
    packed = loader.pinned[aid]
    assert loader(aid) is packed  # the engine's load takes the pinned bytes: no second acquire
    # Held for the engine until used, then given back like any adapter the pool no longer holds.
    assert loader.release_evicted(resident={aid}) == []
    loader.prefetched.clear()
    assert loader.release_evicted(resident=set()) == [aid]


def test_ready_for_an_unknown_adapter_lets_the_load_raise(loader):
    assert loader.ready("tenant:nobody@0000000000000000") is False
    deadline = time.monotonic() + 20
    while not loader.ready("tenant:nobody@0000000000000000"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(KeyError):
        loader("tenant:nobody@0000000000000000")


def test_an_acquire_the_store_never_answers_fails_its_request_after_the_timeout(tiny_model_dir):
    # A store that died with the acquire in flight: `ready` gives up after the acquire timeout, as a
    # blocking load would, and the engine's load then raises at once instead of waiting again.
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # takes the acquire and never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    cfg = ModelConfig.from_dir(tiny_model_dir)
    loader = ArenaAdapterLoader(StoreClient(ctx, f"tcp://127.0.0.1:{port}", "lost-test", timeout_s=0.3),
                                ArenaSegments(False), cfg.num_layers, cfg.kv_dim)
    try:
        assert loader.ready("tenant:a@0000000000000000") is False
        started = time.monotonic()
        while not loader.ready("tenant:a@0000000000000000"):
            assert time.monotonic() - started < 5, "ready never gave up"
            time.sleep(0.02)
        assert time.monotonic() - started >= 0.25
        started = time.monotonic()
        with pytest.raises(AdapterUnavailable, match="did not answer"):
            loader("tenant:a@0000000000000000")
        assert time.monotonic() - started < 0.1  # raised at once, no second wait
        assert loader.ready("tenant:a@0000000000000000") is False  # asked again: a fresh acquire
    finally:
        loader.store.close()
        sink.close(0)
        ctx.term()


class _BusyStore:
    """A store's socket that answers Pings at once and holds each AcquireAdapter for `hold_s` (forever when
    None) before refusing it as not found: a store alive but slow to hand adapters out."""

    def __init__(self, ctx, hold_s: float | None):
        import threading

        self.sock = ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.hold_s = hold_s
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from shared.wire import Ping, Pong, StoreError, decode, encode

        held = []
        while not self.stopping:
            if self.sock.poll(10):
                identity, *frames = self.sock.recv_multipart()
                msg = decode(frames)
                if isinstance(msg, Ping):
                    self.sock.send_multipart([identity, *encode(Pong(service="adapter_store", call_id=msg.call_id))])
                elif isinstance(msg, AcquireAdapter):
                    held.append((time.monotonic(), identity, msg))
            for item in list(held):
                since, identity, msg = item
                if self.hold_s is not None and time.monotonic() - since >= self.hold_s:
                    held.remove(item)
                    refusal = StoreError(status=404, code="not_found", message=f"no adapter {msg.adapter}",
                                         call_id=msg.call_id)
                    self.sock.send_multipart([identity, *encode(refusal)])
        self.sock.close(0)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)


@pytest.mark.parametrize("hold_s", [1.2, None])
def test_an_acquire_waits_past_the_timeout_while_the_store_answers_other_calls(tiny_model_dir, hold_s):
    # Loads from disk queue behind each other in a busy store: an acquire outliving the acquire timeout is
    # not given up on while the store answers anything else; it ends with the store's own answer, or after
    # the load timeout when none comes.
    ctx = zmq.Context()
    store = _BusyStore(ctx, hold_s)
    cfg = ModelConfig.from_dir(tiny_model_dir)
    client = StoreClient(ctx, f"tcp://127.0.0.1:{store.port}", "busy-test", timeout_s=0.3)
    loader = ArenaAdapterLoader(client, ArenaSegments(False), cfg.num_layers, cfg.kv_dim, load_timeout_s=2.0)
    adapter = "tenant:a@0000000000000000"
    try:
        assert loader.ready(adapter) is False
        started = time.monotonic()
        while not loader.ready(adapter):
            assert time.monotonic() - started < 6, "ready never ended"
            assert client.arena_name(timeout_s=0.1) == ""  # the store answers (a Pong without an arena)
            time.sleep(0.02)
        waited = time.monotonic() - started
        if hold_s is not None:
            assert hold_s - 0.1 <= waited < 2.0
            with pytest.raises(KeyError, match="no adapter"):  # the store's answer, not a timeout
                loader(adapter)
        else:
            assert waited >= 1.9
            with pytest.raises(AdapterUnavailable, match="did not hand the adapter out within 2s"):
                loader(adapter)
    finally:
        client.close()
        store.stop()
        ctx.term()


def test_a_full_arena_makes_the_request_wait_and_ask_again_later(tmp_path, tiny_model_dir, tiny_adapter_dirs):
    # An arena with room for one wide adapter, held by another worker: the loader's acquire is refused as
    # arena_full; the request is not failed, the loader does not ask again at every step, and once the
    # other worker lets go the adapter comes.
    from services.gpu_worker.arena_client import ARENA_FULL_RETRY_S
    from shared.wire import ReleaseAdapter

    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    store = StoreProcess(redis_server.url, tmp_path / "data", tiny_model_dir, None, arena_bytes=512 * 1024)
    store.start()
    ctx = zmq.Context()
    cfg = ModelConfig.from_dir(tiny_model_dir)
    loader = ArenaAdapterLoader(StoreClient(ctx, store.address, "full-test", timeout_s=20), ArenaSegments(False),
                                cfg.num_layers, cfg.kv_dim)
    other = store.client()
    try:
        held, wanted = (register(store, tiny_adapter_dirs[3], name) for name in ("wide-held", "wide-wanted"))
        other.call(AcquireAdapter(held, "other-worker"))  # 360 KiB of the 512 pinned elsewhere
        deadline = time.monotonic() + 20
        while wanted not in loader.retry_at:
            assert loader.ready(wanted) is False and wanted not in loader.failed
            assert time.monotonic() < deadline, "the store never answered"
            time.sleep(0.01)
        assert loader.ready(wanted) is False and wanted not in loader.pending  # not asked again at once
        other.call(ReleaseAdapter(held, "other-worker"))
        time.sleep(ARENA_FULL_RETRY_S)
        while not loader.ready(wanted):
            assert time.monotonic() < deadline, "the adapter never came once the arena had room"
            time.sleep(0.01)
        assert loader(wanted).rows.numel() > 0
    finally:
        other.close()
        loader.store.close()
        ctx.term()
        store.stop()
        redis_server.stop()
