"""Adapter management through the REST API and the `loraplex adapters` client, against the running stack:
upload and use at once, register from a server path, idempotent re-registration and conflicts, list / get /
delete, deleting an adapter while a request streams with it, and the vLLM-compatible aliases."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

from tokenizers import Tokenizer

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from tests.e2e.conftest import REPO, upload

PROMPT = [1, 40, 41, 42, 43, 44]


def greedy(client, model: str, max_tokens: int = 8) -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def engine_text(model_dir, folder, max_tokens: int = 8) -> str:
    cfg = ModelConfig.from_dir(model_dir)
    engine = Engine.from_model_dir(model_dir, EngineConfig(num_slots=1024))
    engine.register_adapter("a", load_adapter(folder, cfg, name="a"))
    engine.add_request(EngineRequest("x", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter="a"))
    ids = []
    while engine.has_unfinished():
        for o in engine.step():
            ids += o.new_token_ids
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def test_upload_then_use_at_once(stack, model_dir, tmp_path):
    folder = make_adapters(tmp_path, model_dir, 1, ranks=[12], seed=101, prefix="fresh")[0]
    with stack.client() as c:
        r = upload(c, folder, "fresh-upload")
        assert r.status_code == 201, r.text
        card = r.json()
        assert card["name"] == "fresh-upload" and card["rank"] == 12
        assert len(card["sha256"]) == 64 and card["bytes"] > 0 and card["id"]
        out = greedy(c, "fresh-upload")
    assert out["model"] == "fresh-upload"
    assert out["choices"][0]["text"] == engine_text(model_dir, folder)


def test_same_content_is_idempotent_other_content_conflicts(stack, model_dir, tmp_path):
    a, b = make_adapters(tmp_path, model_dir, 2, ranks=[4], seed=202, prefix="dup")
    with stack.client() as c:
        first = upload(c, a, "dup-name")
        assert first.status_code == 201, first.text
        again = upload(c, a, "dup-name")
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        other = upload(c, b, "dup-name")
        assert other.status_code == 409, other.text
        assert other.json()["error"]["message"]
        # The conflicting upload changed nothing: the name still serves the first content.
        assert c.get("/v1/adapters/dup-name").json()["sha256"] == first.json()["sha256"]


def test_register_from_server_path(stack, model_dir, allowed_root, tmp_path):
    folder = make_adapters(tmp_path, model_dir, 1, ranks=[8], seed=303, prefix="onserver")[0]
    inside = allowed_root / "onserver"
    shutil.copytree(folder, inside)
    with stack.client() as c:
        r = c.post("/v1/adapters", json={"name": "from-path", "path": str(inside)})
        assert r.status_code == 201, r.text
        assert greedy(c, "from-path")["choices"][0]["text"] == engine_text(model_dir, folder)
        # The same folder outside the allowed root is refused.
        r = c.post("/v1/adapters", json={"name": "from-outside", "path": str(folder)})
        assert r.status_code == 400, r.text
        assert c.get("/v1/adapters/from-outside").status_code == 404


def test_list_get_delete(stack, model_dir, tmp_path):
    folder = make_adapters(tmp_path, model_dir, 1, ranks=[16], seed=404, prefix="doomed",
                           targets=["q_proj", "v_proj"])[0]
    with stack.client() as c:
        assert upload(c, folder, "doomed").status_code == 201
        listed = {a["name"]: a for a in c.get("/v1/adapters").json()["data"]}
        assert listed["doomed"]["rank"] == 16 and listed["doomed"]["target_modules"] == ["q_proj", "v_proj"]
        card = c.get("/v1/adapters/doomed").json()
        assert card == {**listed["doomed"], "residency": card["residency"]}
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["doomed"]["parent"] == "model" and models["doomed"]["rank"] == 16
        greedy(c, "doomed")

        assert c.delete("/v1/adapters/doomed").status_code == 204
        assert c.get("/v1/adapters/doomed").status_code == 404
        assert "doomed" not in {a["name"] for a in c.get("/v1/adapters").json()["data"]}
        assert "doomed" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/completions", json={"model": "doomed", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert c.delete("/v1/adapters/doomed").status_code == 404


def test_delete_while_in_use_lets_in_flight_finish_then_404(stack, model_dir, tmp_path):
    folder = make_adapters(tmp_path, model_dir, 1, ranks=[8], seed=505, prefix="busy")[0]
    with stack.client() as c:
        assert upload(c, folder, "busy").status_code == 201
    events: list[dict] = []
    first_token = threading.Event()

    def stream():
        with stack.client(timeout=120) as c:
            body = {"model": "busy", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        first_token.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(60), "no token streamed"
    with stack.client() as c:
        assert c.delete("/v1/adapters/busy").status_code == 204
        r = c.post("/v1/completions", json={"model": "busy", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404
    t.join(120)
    assert not t.is_alive()
    finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [60]


def test_vllm_aliases_load_and_unload(stack, model_dir, allowed_root, tmp_path):
    folder = make_adapters(tmp_path, model_dir, 1, ranks=[4], seed=606, prefix="vllm")[0]
    inside = allowed_root / "vllm-style"
    shutil.copytree(folder, inside)
    with stack.client() as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "vllm-style", "lora_path": str(inside)})
        assert r.status_code == 200, r.text
        greedy(c, "vllm-style", 3)
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}).status_code == 200
        assert c.get("/v1/adapters/vllm-style").status_code == 404


def run_cli(stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "adapters", "--url", stack.url, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_adapters_cli_bulk_add_list_remove(stack, model_dir, tmp_path):
    folders = make_adapters(tmp_path, model_dir, 5, ranks=[4, 8], seed=707, prefix="cli")
    added = run_cli(stack, "add", *map(str, folders))
    assert added.returncode == 0, added.stderr
    assert added.stdout.count("added") == 5
    assert "5/5" in added.stderr  # the progress bar reached the end
    again = run_cli(stack, "add", str(folders[0]))
    assert again.returncode == 0 and "unchanged" in again.stdout

    listed = run_cli(stack, "ls")
    assert listed.returncode == 0
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert {f.name for f in folders} <= set(rows)
    assert rows["cli-000"][1] == "4" and rows["cli-001"][1] == "8"

    removed = run_cli(stack, "rm", "cli-000", "cli-001")
    assert removed.returncode == 0, removed.stderr
    missing = run_cli(stack, "rm", "cli-000")
    assert missing.returncode == 1 and "404" in missing.stderr
    assert "cli-000" not in run_cli(stack, "ls").stdout
    not_a_folder = run_cli(stack, "add", str(tmp_path / "nothing-here"))
    assert not_a_folder.returncode == 2 and "not an adapter folder" in not_a_folder.stderr
