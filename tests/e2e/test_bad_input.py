"""Bad input through the whole stack: each refused with its status and an OpenAI-style error body naming the
problem, nothing stored (no registration, no blob), and the server keeps serving."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load, save

from shared.make_adapters import make_adapters
from tests.e2e.conftest import UPLOAD_CAP, upload


def error_of(r, status: int | tuple[int, ...]) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def blobs(stack) -> set[str]:
    folder = stack.data_dir / "blobs"
    return set(os.listdir(folder)) if folder.is_dir() else set()


@pytest.fixture(scope="module")
def good(stack, model_dir, tmp_path_factory):
    """One valid adapter folder (never registered) to corrupt in each test."""
    return make_adapters(tmp_path_factory.mktemp("bad-input"), model_dir, 1, ranks=[4], seed=909, prefix="victim")[0]


def completion(client, **fields):
    body = {"model": "model", "prompt": [1, 5, 6], "max_tokens": 3, "temperature": 0}
    body.update(fields)
    return client.post("/v1/completions", json=body)


def test_unknown_adapter_is_404_never_the_base(stack):
    with stack.client() as c:
        err = error_of(completion(c, model="no-such-adapter"), 404)
        assert "no-such-adapter" in err["message"]
        error_of(c.post("/v1/chat/completions", json={"model": "no-such-adapter",
                                                      "messages": [{"role": "user", "content": "hi"}]}), 404)
        error_of(c.get("/v1/adapters/no-such-adapter"), 404)


def test_malformed_json_is_400(stack):
    with stack.client() as c:
        r = c.post("/v1/completions", content=b'{"model": "model", "prompt": ', headers={"content-type": "application/json"})
        error_of(r, 400)
        error_of(c.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"n": 3}, "n"),
])
def test_bad_fields_are_400(stack, fields, param):
    with stack.client() as c:
        err = error_of(completion(c, **fields), (400, 422))
        assert err["param"] == param or param in err["message"], err


def test_prompt_too_long_is_400(stack):
    with stack.client() as c:
        err = error_of(completion(c, prompt=[1] + [7] * 2100), 400)
        assert "2048" in err["message"] or "context" in err["message"]
        error_of(completion(c, prompt=[1, 2, 3], max_tokens=5000), 400)


def test_server_keeps_serving_after_bad_requests(stack):
    with stack.client() as c:
        assert completion(c).status_code == 200


def _refused_upload(stack, folder, name, status, config=None, weights=None) -> dict:
    before = blobs(stack)
    with stack.client() as c:
        err = error_of(upload(c, folder, name, config=config, weights=weights), status)
        assert c.get(f"/v1/adapters/{name}").status_code in (404, 400)
    assert blobs(stack) == before, "a refused upload left a blob behind"
    return err


class Payload:
    """Unpickling this would create a file; the server must never unpickle anything."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_upload_is_refused_unopened(stack, good, tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": Payload(str(marker))})
    _refused_upload(stack, good, "pickled", 400, weights=blob)
    assert not marker.exists()


def test_nan_weights_are_refused(stack, good):
    tensors = load((good / "adapter_model.safetensors").read_bytes())
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    err = _refused_upload(stack, good, "has-nan", 400, weights=save(tensors))
    assert "finite" in err["message"].lower() or "nan" in err["message"].lower()


def test_wrong_shapes_are_refused(stack, good):
    tensors = load((good / "adapter_model.safetensors").read_bytes())
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    _refused_upload(stack, good, "bad-shape", 400, weights=save(tensors))


@pytest.mark.parametrize("change", [{"r": 0}, {"peft_type": "IA3"}, {"use_dora": True}, {"target_modules": ["lm_head"]}])
def test_bad_config_is_refused(stack, good, change):
    config = json.loads((good / "adapter_config.json").read_text())
    config.update(change)
    _refused_upload(stack, good, "bad-config", 400, config=json.dumps(config).encode())


def test_config_that_is_not_json_is_refused(stack, good):
    _refused_upload(stack, good, "not-json", 400, config=b"{not json")


@pytest.mark.parametrize("name", ["../evil", "a/b", "UPPER", ".hidden", "x" * 65, "%2e%2e%2fetc", ""])
def test_hostile_names_are_refused(stack, good, name):
    before = blobs(stack)
    with stack.client() as c:
        error_of(upload(c, good, name), 400)
    assert blobs(stack) == before


def test_hostile_paths_are_refused(stack, good, allowed_root, tmp_path):
    escape = allowed_root / "escape"
    if not escape.exists():
        escape.symlink_to(good, target_is_directory=True)
    with stack.client() as c:
        for path in [str(good), str(allowed_root / ".." / good.parent.name / good.name), str(escape), "/etc",
                     "relative/path", str(allowed_root / "missing")]:
            err = error_of(c.post("/v1/adapters", json={"name": "by-path", "path": path}), (400, 404))
            assert err["message"], path
        assert c.get("/v1/adapters/by-path").status_code == 404


def test_oversize_upload_is_413(stack, good):
    weights = (good / "adapter_model.safetensors").read_bytes() + b"\0" * (UPLOAD_CAP + 1)
    _refused_upload(stack, good, "oversize", 413, weights=weights)


def test_duplicate_name_with_other_content_is_409(stack, model_dir, tmp_path):
    a, b = make_adapters(tmp_path, model_dir, 2, ranks=[4, 8], seed=910, prefix="twin")
    with stack.client() as c:
        assert upload(c, a, "twin").status_code == 201
        before = blobs(stack)
        error_of(upload(c, b, "twin"), 409)
        assert blobs(stack) == before
