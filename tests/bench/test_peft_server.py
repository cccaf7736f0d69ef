"""The HF PEFT baseline server as a real process over real HTTP, on the tiny model and real PEFT adapters.

Outputs are checked against transformers + peft run directly in this process (fresh PeftModel per adapter,
`generate` without padding), turned into text by the same incremental detokenizer the server uses, so equal
text means equal tokens. Two servers run side by side: one from the checkpoint with every adapter
resident, one from --dummy-weights with --max-loaded 1 (every adapter switch evicts).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from bench import REPO, child_env
from bench.baselines.grouping import GroupingQueue, PendingRequest
from bench.baselines.peft_model import build_base_model, index_adapters
from services.gateway.detokenize import IncrementalDetokenizer
from shared.ports import free_port

BASE = "model"  # the tiny checkpoint's folder name, the base model's default served name
A0, A1, A2 = "adapter-000", "adapter-001", "adapter-002"
MAX_BATCH = 4
START_TIMEOUT_S = 120.0


class PeftServer:
    def __init__(self, log_path: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "bench.baselines.peft_server", "--port", str(self.port), "--device", "cpu",
               "--dtype", "float32", *args]
        env = child_env(OMP_NUM_THREADS="1")
        self.log_file = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self) -> PeftServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready within {START_TIMEOUT_S}s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10.0).json()

    def idle_stats(self, timeout_s: float = 10.0) -> dict:
        """/stats once nothing runs or waits: a batch's record is written just after its last token is sent."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if (stats["running"] == 0 and stats["queue_depth"] == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()


@pytest.fixture(scope="module")
def adapters_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from shared.make_adapters import make_adapters

    out = tmp_path_factory.mktemp("peft-adapters")
    make_adapters(out, tiny_model_dir, 3, ranks=[8, 16, 4], seed=3)
    return out


@pytest.fixture(scope="module")
def servers(tiny_model_dir, adapters_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("peft-logs")
    # Started together so their imports and model builds overlap.
    main = PeftServer(logs / "main.log", "--model", str(tiny_model_dir), "--adapters-dir", str(adapters_dir),
                      "--max-batch", str(MAX_BATCH))
    lru = PeftServer(logs / "lru.log", "--dummy-weights", str(tiny_model_dir), "--adapters-dir", str(adapters_dir),
                     "--max-loaded", "1")
    try:
        yield main.wait_ready(), lru.wait_ready()
    finally:
        main.stop()
        lru.stop()


@pytest.fixture(scope="module")
def main_server(servers) -> PeftServer:
    return servers[0]


@pytest.fixture(scope="module")
def lru_server(servers) -> PeftServer:
    return servers[1]


class Reference:
    """Greedy outputs of transformers + peft, one unpadded request at a time, as the server's texts."""

    def __init__(self, base, adapters: dict[str, Path], tokenizer):
        base.generation_config.eos_token_id = None  # the server ignores EOS when asked to: so does this
        self.base = base
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.models: dict[str | None, torch.nn.Module] = {None: base}

    def _model(self, adapter: str | None):
        from peft import PeftModel

        if adapter not in self.models:
            self.models[adapter] = PeftModel.from_pretrained(copy.deepcopy(self.base), str(self.adapters[adapter])).eval()
        return self.models[adapter]

    def token_ids(self, adapter: str | None, prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = self._model(adapter).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                                max_new_tokens=n, do_sample=False, pad_token_id=3)
        ids = out[0, len(prompt):].tolist()
        assert len(ids) == n
        return ids

    def pieces(self, adapter: str | None, prompt: list[int], n: int) -> list[str]:
        """The text each generated token adds, as a stream sends it."""
        detok = IncrementalDetokenizer(self.tokenizer)
        ids = self.token_ids(adapter, prompt, n)
        out = [detok.push([t]) for t in ids]
        out[-1] += detok.flush()
        return out

    def text(self, adapter: str | None, prompt: list[int], n: int) -> str:
        return "".join(self.pieces(adapter, prompt, n))


def _tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters_dir) -> Reference:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return Reference(base, index_adapters(adapters_dir), _tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def dummy_reference(tiny_model_dir, adapters_dir) -> Reference:
    # --dummy-weights builds random weights from the config, seed 0: the same call here gives the same model.
    base = build_base_model(None, tiny_model_dir, "cpu", torch.float32, seed=0)
    return Reference(base, index_adapters(adapters_dir), _tokenizer(tiny_model_dir))


def _prompt(length: int, salt: int) -> list[int]:
    return [1] + [7 + (salt * 31 + i * 17) % 500 for i in range(length - 1)]


def _body(model: str, prompt, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def _complete(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> dict:
    r = client.post("/v1/completions", json=_body(model, prompt, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()


def _events(lines) -> list:
    """SSE `data:` payloads in order, [DONE] as the string itself."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the queue's grouping rule, in process --------------------------------------------------------------

def _pending(rid: str, adapter: str | None) -> PendingRequest:
    return PendingRequest(request_id=rid, adapter=adapter, prompt_ids=[1], max_tokens=1)


def test_queue_takes_the_oldest_requests_adapter_up_to_max_batch():
    q = GroupingQueue(max_batch=2)
    for rid, adapter in [("r0", "a"), ("r1", "b"), ("r2", "a"), ("r3", None), ("r4", "a"), ("r5", "b"), ("r6", None)]:
        q.put(_pending(rid, adapter))
    taken = []
    while q.depth():
        batch = q.take_batch(timeout_s=0)
        taken.append([r.request_id for r in batch])
    assert taken == [["r0", "r2"], ["r1", "r5"], ["r3", "r6"], ["r4"]]
    assert q.take_batch(timeout_s=0.01) is None


def test_queue_drops_cancelled_requests_and_close_returns_the_rest():
    q = GroupingQueue(max_batch=8)
    reqs = [_pending(f"r{i}", "a" if i % 2 else "b") for i in range(4)]
    for r in reqs:
        q.put(r)
    reqs[0].cancelled = True  # "b": the oldest live request is now r1 ("a")
    assert [r.request_id for r in q.take_batch(timeout_s=0)] == ["r1", "r3"]
    assert [r.request_id for r in q.close()] == ["r2"]
    assert q.take_batch() is None


# ---- model building and adapter discovery, in process ---------------------------------------------------

def test_dummy_weights_are_seeded_in_the_requested_dtype(tiny_model_dir):
    a = build_base_model(None, tiny_model_dir / "config.json", "cpu", torch.bfloat16, seed=0)
    b = build_base_model(None, tiny_model_dir / "config.json", "cpu", torch.bfloat16, seed=0)
    c = build_base_model(None, tiny_model_dir / "config.json", "cpu", torch.bfloat16, seed=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert wa.dtype == torch.bfloat16 and wa.device.type == "cpu"
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_adapter_folders_without_safetensors_are_refused(tmp_path, adapters_dir):
    import shutil

    good = tmp_path / "good"
    shutil.copytree(adapters_dir / A0, good / A0)
    assert list(index_adapters(good)) == [A0]
    pickled = tmp_path / "pickled" / "old"
    pickled.mkdir(parents=True)
    (pickled / "adapter_config.json").write_text((adapters_dir / A0 / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not opened")
    with pytest.raises(ValueError, match="adapter_model.safetensors.*pickled"):
        index_adapters(pickled.parent)
    bare = tmp_path / "bare" / "empty"
    bare.mkdir(parents=True)
    with pytest.raises(ValueError, match="adapter_config.json"):
        index_adapters(bare.parent)


# ---- the server over HTTP -----------------------------------------------------------------------------

def test_health_and_models_list_the_base_and_every_adapter(main_server):
    with main_server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        models = c.get("/v1/models").json()
    ids = [m["id"] for m in models["data"]]
    assert ids == [BASE, A0, A1, A2]
    assert all(m["parent"] == BASE for m in models["data"][1:])


def test_greedy_outputs_equal_transformers_peft(main_server, reference):
    # Three prompt lengths and output lengths per model, sent at once: batches are padded on the left and
    # run to their longest max_tokens, each output cut to its own.
    jobs = [(model, _prompt(length, salt), n)
            for salt, model in enumerate([A0, A1, None])
            for length, n in [(5, 7), (12, 16), (30, 11)]]
    with main_server.client() as c, concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda j: _complete(c, j[0] or BASE, j[1], j[2]), jobs))
    for (model, prompt, n), reply in zip(jobs, replies):
        assert reply["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["choices"][0]["text"] == reference.text(model, prompt, n), (model, len(prompt), n)
    # The adapters really change the output (otherwise equality above would prove little).
    texts = {model: reply["choices"][0]["text"] for (model, _, _), reply in zip(jobs, replies)}
    assert len(set(texts.values())) == 3


def test_requests_are_grouped_one_adapter_per_batch_oldest_first(main_server, reference):
    # A long base-model request holds the worker; meanwhile 8 requests for two adapters queue, interleaved.
    # Response headers come back once a request is queued, so opening the streams one by one fixes their
    # arrival order.
    order = [A0, A1, A0, A1, A0, A1, A0, A0]
    prompts = [_prompt(6 + i, 40 + i) for i in range(len(order))]
    with main_server.client() as c, contextlib.ExitStack() as streams:
        with c.stream("POST", "/v1/completions", json=_body(BASE, [1, 2, 3], 800, stream=True)) as blocker:
            lines = blocker.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is running now
            responses = [streams.enter_context(c.stream("POST", "/v1/completions", json=_body(m, p, 5, stream=True)))
                         for m, p in zip(order, prompts)]
            running = main_server.stats()
            for _ in lines:
                pass
        texts, ids = [], []
        for resp in responses:
            events = _events(resp.iter_lines())
            ids.append(events[0]["id"])
            texts.append("".join(e["choices"][0]["text"] for e in events[:-1]))
    assert running["queue_depth"] == len(order), "the blocker ended before every request was queued"
    groups = [b for b in main_server.idle_stats()["batches"] if set(b["request_ids"]) & set(ids)]
    assert [(b["adapter"], b["request_ids"]) for b in groups] == [
        (A0, [ids[0], ids[2], ids[4], ids[6]]),  # oldest waiting is A0: its first max_batch requests
        (A1, [ids[1], ids[3], ids[5]]),  # then the oldest left is A1's
        (A0, [ids[7]]),
    ]
    assert all(b["prompt_lens"] == [len(prompts[ids.index(r)]) for r in b["request_ids"]] for b in groups)
    for model, prompt, text in zip(order, prompts, texts):
        assert text == reference.text(model, prompt, 5)


def test_a_queued_request_whose_client_leaves_never_runs(main_server):
    before = main_server.idle_stats()["batches_total"]
    with main_server.client() as c, \
            c.stream("POST", "/v1/completions", json=_body(BASE, [1, 2, 3], 500, stream=True)) as blocker:
        lines = blocker.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        with c.stream("POST", "/v1/completions", json=_body(A2, [1, 4, 5], 50, stream=True)) as gone:
            assert gone.status_code == 200
        # The connection closed with the body unread: the server sees the disconnect while it is queued.
        deadline = time.monotonic() + 10
        while main_server.stats()["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert main_server.stats()["queue_depth"] == 0
        for _ in lines:
            pass
    s = main_server.idle_stats()
    assert s["batches_total"] == before + 1  # the blocker's batch alone
    assert s["batches"][-1]["adapter"] is None


def test_stream_sends_one_chunk_per_token_and_usage(main_server, reference):
    prompt, n = _prompt(9, 7), 12
    body = _body(A2, prompt, n, stream=True, stream_options={"include_usage": True})
    with main_server.client() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    *tokens, usage = events[:-1]
    assert len(tokens) == n
    rid = tokens[0]["id"]
    for i, chunk in enumerate(tokens):
        assert chunk["id"] == rid and chunk["object"] == "text_completion" and chunk["model"] == A2
        assert chunk["usage"] is None
        assert chunk["choices"][0]["finish_reason"] == ("length" if i == n - 1 else None)
    assert [t["choices"][0]["text"] for t in tokens] == reference.pieces(A2, prompt, n)
    assert usage["id"] == rid and usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def test_string_prompt_is_tokenized(main_server, reference):
    tok = reference.tokenizer
    prompt = tok.encode("the adapter").ids
    with main_server.client() as c:
        reply = c.post("/v1/completions", json=_body(A1, "the adapter", 6)).json()
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["choices"][0]["text"] == reference.text(A1, prompt, 6)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2], "max_tokens": 4, "temperature": 0}, "model"),
    (_body(BASE, [1, 2], 0), "max_tokens"),
    (_body(BASE, [1, 2], "4"), "max_tokens"),
    (_body(BASE, [1, 2], 4000), "max_tokens"),
    (_body(BASE, [1, 99999], 4), "prompt"),
    (_body(BASE, [], 4), "prompt"),
    ({**_body(BASE, [1, 2], 4), "temperature": 0.7}, "temperature"),
    ({"model": BASE, "prompt": [1, 2], "max_tokens": 4}, "temperature"),
    (_body(BASE, [1, 2], 4, stream_options={"include_usage": True}), "stream_options"),
    (_body(BASE, [1, 2], 4, stop=["x"]), "stop"),
    (_body(BASE, [1, 2], 4, best_of=3), "best_of"),
    (_body(BASE, [1, 2], 4, surprise=1), "surprise"),
])
def test_bad_input_is_400_naming_the_field(main_server, body, param):
    with main_server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_is_400(main_server):
    with main_server.client() as c:
        r = c.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_unknown_model_is_404(main_server):
    with main_server.client() as c:
        r = c.post("/v1/completions", json=_body("adapter-999", [1, 2], 4))
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


def test_lru_of_one_adapter_evicts_and_outputs_stay_correct(lru_server, dummy_reference):
    # Started with --dummy-weights (seed 0) and --max-loaded 1: A0 is preloaded, every switch loads one
    # adapter and deletes the previous one.
    before = lru_server.idle_stats()
    assert before["resident"] == [A0] and before["adapter_loads"] == 1
    sequence = [A0, A1, A2, A0, None, A1]
    with lru_server.client() as c:
        for i, model in enumerate(sequence):
            prompt = _prompt(8 + i, 90 + i)
            reply = _complete(c, model or BASE, prompt, 9)
            assert reply["choices"][0]["text"] == dummy_reference.text(model, prompt, 9), (i, model)
    after = lru_server.idle_stats()
    assert after["resident"] == [A1]
    assert after["adapter_loads"] == 5 and after["adapter_evictions"] == 4
    assert [b["adapter"] for b in after["batches"]] == sequence
