"""The gpu_worker process behind real ZeroMQ: a real adapter_store (with its redis-server and shared-memory
arena) hands out adapters, and the test plays the scheduler on the worker's socket, speaking the wire
protocol exactly as the scheduler does."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import zmq

from services.adapter_store.client import StoreClient
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.wire import (AdapterRegistered, Assign, PrefetchHint, RegisterAdapter, SubmitRequest, TokenBatch,
                         WorkerAbort, WorkerStatus, decode, encode)
from tests.adapter_store.conftest import REPO, RedisServer, StoreProcess, adapter_files, free_port

NUM_SLOTS = 2048


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir, tiny_adapter_dirs):
    """redis-server + adapter_store with the four tiny adapters registered, a worker process, and the ROUTER
    socket the worker connects to in place of the scheduler's."""
    root = tmp_path_factory.mktemp("worker-service")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    store = StoreProcess(redis_server.url, root / "data", tiny_model_dir, None)
    store.start()
    client = store.client()
    ids = {}
    for folder in tiny_adapter_dirs:
        config, weights = adapter_files(folder)
        reply = client.call(RegisterAdapter(name=folder.name, config_json=config, model_safetensors=weights))
        assert isinstance(reply, AdapterRegistered)
        ids[folder.name] = reply.card.id
    client.close()

    ctx = zmq.Context()
    peer = start_worker(ctx, root, tiny_model_dir, store.address)
    try:
        yield peer, ids
    finally:
        peer.close()
        ctx.term()
        store.stop()
        redis_server.stop()


def start_worker(ctx, root, model_dir, store_address: str, *extra: str, worker_id: str = "w0") -> "SchedulerSide":
    """A worker process connected to a ROUTER socket bound here, in place of the scheduler's; returns once the
    worker reports ready."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    router.bind(addr)
    log_path = root / f"{worker_id}.log"
    log = open(log_path, "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "services.gpu_worker", "--model", str(model_dir), "--worker-id", worker_id,
         "--scheduler-addr", addr, "--store-addr", store_address, "--num-slots", str(NUM_SLOTS),
         "--ready-file", str(root / f"{worker_id}.ready"), "--heartbeat-s", "0.1", *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    peer = SchedulerSide(router, worker, log_path, log, worker_id)
    peer.store_address = store_address
    try:
        peer.first_status = peer.status(lambda s: s.ready, timeout=120)
    except BaseException:
        peer.close()
        raise
    return peer


class SchedulerSide:
    """The scheduler's end of the worker socket, with a backlog so tests can wait for one kind of message."""

    def __init__(self, router, proc, log_path, log_file, worker_id: str):
        self.router = router
        self.proc = proc
        self.log_path = log_path
        self.log_file = log_file
        self.worker_id = worker_id
        self.identity: bytes | None = None
        self.backlog: list = []

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log_file.close()
        self.router.close(0)

    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            if self.backlog:
                return self.backlog.pop(0)
            left = deadline - time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            if left <= 0:
                raise TimeoutError(f"worker silent: {self.log_path.read_text()[-3000:]}")
            if self.router.poll(min(left, 0.5) * 1000):
                identity, *frames = self.router.recv_multipart()
                self.identity = identity
                return decode(frames)

    def send(self, msg) -> None:
        assert self.identity is not None
        self.router.send_multipart([self.identity, *encode(msg)])

    def status(self, pred, timeout: float = 10.0) -> WorkerStatus:
        deadline = time.monotonic() + timeout
        kept = []
        try:
            while True:
                msg = self._recv(max(0.01, deadline - time.monotonic()))
                if isinstance(msg, WorkerStatus) and pred(msg):
                    return msg
                if not isinstance(msg, WorkerStatus):
                    kept.append(msg)
        finally:
            self.backlog[:0] = kept

    def run(self, requests: list[SubmitRequest], timeout: float = 60.0) -> dict[str, dict]:
        """Assign requests and collect every one's tokens until it finishes."""
        self.send(Assign(requests=requests))
        results = {r.request_id: {"tokens": [], "finish": None, "error": None} for r in requests}
        deadline = time.monotonic() + timeout
        while any(r["finish"] is None for r in results.values()):
            msg = self._recv(max(0.01, deadline - time.monotonic()))
            if not isinstance(msg, TokenBatch):
                continue
            assert msg.worker_id == self.worker_id
            for out in msg.outputs:
                r = results[out.request_id]
                assert r["finish"] is None, f"{out.request_id} got output after it finished"
                r["tokens"] += out.token_ids.tolist()
                if out.finished:
                    r["finish"], r["error"] = out.finish_reason, out.error
        return results


def submit(rid: str, prompt: list[int], adapter: str | None = None, max_tokens: int = 12, **kw) -> SubmitRequest:
    return SubmitRequest(request_id=rid, prompt_ids=prompt, adapter=adapter, max_tokens=max_tokens,
                         temperature=0.0, ignore_eos=True, gateway_id="gw", **kw)


def reference_tokens(model_dir, adapter_dirs, ids, cases):
    """Greedy tokens of the same requests from the in-process engine."""
    cfg = ModelConfig.from_dir(model_dir)
    engine = Engine.from_model_dir(model_dir, EngineConfig(num_slots=NUM_SLOTS))
    for folder in adapter_dirs:
        engine.register_adapter(ids[folder.name], load_adapter(folder, cfg, name=ids[folder.name]))
    for rid, prompt, adapter, n in cases:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), adapter=adapter))
    out = {rid: [] for rid, *_ in cases}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_mixed_adapters_match_in_process_engine(stack, tiny_model_dir, tiny_adapter_dirs):
    peer, ids = stack
    names = [f.name for f in tiny_adapter_dirs]
    cases = [(f"mix-{i}", [1 + i, 17, 40 + 3 * i, 99, 7], (ids[names[i % 4]] if i % 5 else None), 6 + i % 7)
             for i in range(10)]
    results = peer.run([submit(rid, p, a, n) for rid, p, a, n in cases])
    expected = reference_tokens(tiny_model_dir, tiny_adapter_dirs, ids, cases)
    for rid, *_ in cases:
        assert results[rid]["finish"] == "length", results[rid]
        assert results[rid]["tokens"] == expected[rid], rid
    # Adapters stay resident (and reported) after their requests end, as far as the pool holds them.
    status = peer.status(lambda s: s.running == 0 and s.waiting == 0)
    assert status.resident_adapters and set(status.resident_adapters) <= set(ids.values())
    assert status.free_slots + status.adapter_slots == status.total_slots


def test_status_counts_the_steps_by_kind(stack):
    peer, ids = stack
    idle = lambda s: s.running == 0 and s.waiting == 0  # noqa: E731
    before = peer.status(idle)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    results = peer.run([submit(f"counted-{i}", p, ids["adapter-001"], max_tokens=5) for i, p in enumerate(prompts)])
    assert all(r["finish"] == "length" for r in results.values())
    after = peer.status(lambda s: idle(s) and sum(s.step_tokens.values()) > sum(before.step_tokens.values()))

    def delta(field):
        new, old = getattr(after, field), getattr(before, field)
        return {kind: new.get(kind, 0) - old.get(kind, 0) for kind in new}

    # Every prompt token is computed once, and every output token but the last is fed back once.
    tokens = delta("step_tokens")
    assert sum(tokens.values()) == sum(map(len, prompts)) + 3 * 4
    assert tokens["prefill"] >= sum(map(len, prompts))
    steps = delta("step_counts")
    assert steps["prefill"] >= 1 and steps["decode"] >= 4 and steps["graph"] == 0  # no graphs on the CPU
    seconds, launch = delta("step_seconds"), delta("step_launch_seconds")
    assert all(v > 0 for kind, v in seconds.items() if steps[kind])
    # The host's part (scheduling, batch, launches) is within each kind's time; on the CPU kernels run as
    # they are launched, so it is most of an admission step scheduled on the host (the first, at least).
    assert 0 < launch["prefill"] <= seconds["prefill"]
    assert all(0 <= launch[kind] <= seconds[kind] for kind in seconds)
    # Of the steps, those launched ahead of the last one's tokens (overlap_steps, on by default): greedy
    # decode steps of requests still running.
    ahead = delta("step_ahead_counts")
    assert set(ahead) == set(steps) and ahead["decode"] >= 1 and all(ahead[k] <= steps[k] for k in steps)
    # Every step read the one adapter all three requests use, the same rows each time.
    adapters, adapter_bytes = delta("step_adapters"), delta("step_adapter_bytes")
    assert adapters == steps
    per_step = {adapter_bytes[kind] / steps[kind] for kind in steps if steps[kind]}
    assert len(per_step) == 1 and per_step.pop() > 0
    # Each prompt's tokens attended causally once; each of the 5 outputs of each request was sampled once; the
    # decode rows read their contexts.
    assert sum(delta("step_prompt_pairs").values()) == sum(len(p) * (len(p) + 1) // 2 for p in prompts)
    assert sum(delta("step_sampled").values()) == 3 * 5
    assert delta("step_decode_keys")["decode"] >= 4 * sum(len(p) + 1 for p in prompts)
    # And those that were not, by why: the three requests sampled greedily and fitted the pool.
    held_back = delta("steps_held_back")
    assert set(held_back) == {"prompt", "batch", "round", "slots"} and held_back["slots"] == 0, held_back
    # No decode graphs on the CPU: none captured under load, every kind reported.
    assert delta("step_captures") == {kind: 0 for kind in steps}
    assert delta("step_builds") == {kind: 0 for kind in steps}  # the CPU's interpreter builds no kernel
    assert delta("step_gpu_counts") == {kind: 0 for kind in steps}  # no CUDA timing events either


def test_refused_requests_end_with_an_error_entry(stack):
    peer, ids = stack
    unknown = "nobody@0123456789abcdef"
    results = peer.run([
        submit("unknown-adapter", [1, 2, 3], unknown),
        submit("too-long", [1, 2, 3], None, max_tokens=NUM_SLOTS * 4),
        submit("bad-token", [1, 10**6], None),
        submit("fine", [1, 2, 3], None, max_tokens=3),
    ])
    for rid in ("unknown-adapter", "too-long", "bad-token"):
        assert results[rid]["finish"] == "error" and results[rid]["error"], results[rid]
    assert "nobody" in results["unknown-adapter"]["error"]
    assert "context" in results["too-long"]["error"] or "pool" in results["too-long"]["error"]
    assert "vocabulary" in results["bad-token"]["error"]
    assert results["fine"]["finish"] == "length" and len(results["fine"]["tokens"]) == 3


def test_abort_frees_slots_and_reports_the_id(stack):
    peer, ids = stack
    baseline = peer.status(lambda s: s.running == 0 and s.waiting == 0)
    rid = f"long-{uuid.uuid4().hex[:6]}"
    peer.send(Assign(requests=[submit(rid, [1, 5, 9], ids["adapter-002"], max_tokens=300)]))
    peer.status(lambda s: s.running == 1, timeout=20)
    peer.send(WorkerAbort(request_ids=[rid]))
    seen_abort = False
    deadline = time.monotonic() + 20
    while not seen_abort:
        msg = peer._recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, TokenBatch):
            seen_abort = any(o.request_id == rid and o.finished and o.finish_reason == "abort" for o in msg.outputs)
    peer.status(lambda s: rid in s.finished_request_ids)
    after = peer.status(lambda s: s.running == 0 and s.kv_slots == 0)
    assert after.free_slots + after.adapter_slots == after.total_slots
    assert after.free_slots >= baseline.free_slots - (after.adapter_slots - baseline.adapter_slots)


def test_prefetch_hint_makes_an_adapter_resident_before_any_request(stack, tiny_model_dir, tmp_path):
    peer, ids = stack
    folder = make_adapters(tmp_path, tiny_model_dir, 1, ranks=[12], seed=7, prefix="hinted")[0]
    config, weights = adapter_files(folder)
    store_client = StoreClient(peer.store_address, timeout_s=20)
    card = store_client.call(RegisterAdapter(name="hinted-0", config_json=config, model_safetensors=weights)).card
    store_client.close()
    peer.send(PrefetchHint(adapters=[card.id]))
    status = peer.status(lambda s: card.id in s.resident_adapters, timeout=20)
    assert status.running == 0


def test_tensor_parallel_worker_serves_the_same_tokens(stack, tiny_model_dir, tiny_adapter_dirs, tmp_path):
    """`--tp 2` runs the tensor-parallel engine (rank 0 in the worker, one follower process) behind the same
    loop; it reads the same single-GPU rows from the arena and must produce the same tokens."""
    peer, ids = stack
    names = [f.name for f in tiny_adapter_dirs]
    cases = [(f"tp-{i}", [1 + i, 23, 50 + i, 8], (ids[names[i % 4]] if i % 3 else None), 5) for i in range(6)]
    ctx = zmq.Context()
    tp_peer = start_worker(ctx, tmp_path, tiny_model_dir, peer.store_address, "--tp", "2", worker_id="tp0")
    try:
        results = tp_peer.run([submit(rid, p, a, n) for rid, p, a, n in cases])
    finally:
        tp_peer.close()
        ctx.term()
    expected = reference_tokens(tiny_model_dir, tiny_adapter_dirs, ids, cases)
    for rid, *_ in cases:
        assert results[rid]["finish"] == "length", results[rid]
        assert results[rid]["tokens"] == expected[rid], rid


def test_warm_up_runs_before_ready_and_leaves_the_pool_empty(stack, tiny_model_dir, tiny_adapter_dirs, tmp_path):
    """`--warmup on` (the default on CUDA, where it compiles the kernels) runs throwaway requests with a
    throwaway adapter before the first status; the pool is empty again and serving is unchanged."""
    peer, ids = stack
    ctx = zmq.Context()
    warm = start_worker(ctx, tmp_path, tiny_model_dir, peer.store_address, "--warmup", "on", worker_id="warm0")
    try:
        first = warm.first_status
        assert first.resident_adapters == [] and first.running == 0 and first.waiting == 0
        assert first.free_slots == first.total_slots == NUM_SLOTS
        assert first.adapter_loads == 2  # the warm-up adapters (rank 8 and 64), evicted again
        assert "worker.warmed_up" in warm.log_path.read_text()
        cases = [("w-0", [1, 2, 3, 4], ids["adapter-001"], 4), ("w-1", [5, 6, 7], None, 4)]
        results = warm.run([submit(rid, p, a, n) for rid, p, a, n in cases])
    finally:
        warm.close()
        ctx.term()
    expected = reference_tokens(tiny_model_dir, tiny_adapter_dirs, ids, cases)
    assert {rid: r["tokens"] for rid, r in results.items()} == expected
