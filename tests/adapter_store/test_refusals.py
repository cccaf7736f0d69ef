"""Every refusal of a registration names its cause and leaves nothing behind: no blob, no registry key,
no file anywhere outside the data dir."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_st, save as save_st

from services.adapter_store.client import StoreCallError
from shared.wire import GetAdapter, ListAdapters, RegisterAdapter

from .conftest import adapter_files


class _CreatesFile:
    """Unpickling this runs os.system; the store must never unpickle it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tampered(folder: Path, change) -> bytes:
    tensors = load_st((folder / "adapter_model.safetensors").read_bytes())
    change(tensors)
    return save_st(tensors)


def _first_key(tensors, part):
    return sorted(k for k in tensors if part in k)[0]


def _set_nan(tensors):
    tensors[_first_key(tensors, "lora_B")][0, 0] = float("nan")


def _wrong_shape(tensors):
    k = _first_key(tensors, "lora_A")
    tensors[k] = torch.zeros(tensors[k].shape[0], tensors[k].shape[1] + 1)


def _upload_cases(folder: Path, marker: Path):
    config_json, model_st = adapter_files(folder)
    torch_zip = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, torch_zip)
    return {
        "pickle with a payload": (RegisterAdapter("ok", config_json=config_json,
                                                  model_safetensors=pickle.dumps(_CreatesFile(marker))), 400, "pickle_refused"),
        "torch.save zip": (RegisterAdapter("ok", config_json=config_json, model_safetensors=torch_zip.getvalue()), 400, "pickle_refused"),
        "nan weights": (RegisterAdapter("ok", config_json=config_json, model_safetensors=_tampered(folder, _set_nan)), 400, "invalid_adapter"),
        "wrong shapes": (RegisterAdapter("ok", config_json=config_json, model_safetensors=_tampered(folder, _wrong_shape)), 400, "invalid_adapter"),
        "lying safetensors header": (RegisterAdapter("ok", config_json=config_json,
                                                     model_safetensors=(10**12).to_bytes(8, "little") + b"{}"), 400, "invalid_adapter"),
        "not json config": (RegisterAdapter("ok", config_json=b"{r: 8", model_safetensors=model_st), 400, "invalid_adapter_config"),
        "config not an object": (RegisterAdapter("ok", config_json=b"[1]", model_safetensors=model_st), 400, "invalid_adapter_config"),
        "bad config": (RegisterAdapter("ok", config_json=json.dumps({**json.loads(config_json), "r": -3}).encode(),
                                       model_safetensors=model_st), 400, "invalid_adapter"),
        "missing weights": (RegisterAdapter("ok", config_json=config_json), 400, "missing_file"),
        "oversize": (RegisterAdapter("ok", config_json=config_json, model_safetensors=b"\0" * (2 * 2**20)), 413, "adapter_too_large"),
        "files and a path": (RegisterAdapter("ok", config_json=config_json, model_safetensors=model_st, path="a"), 400, "invalid_request"),
        **{f"name {n!r}": (RegisterAdapter(n, config_json=config_json, model_safetensors=model_st), 400, "invalid_name")
           for n in ["", "Upper", "../x", "a/b", "/etc", ".hidden", "-x", "a b", "x" * 65, "a\x00b", "%2e%2e", "ü"]},
        "tenant with a slash": (RegisterAdapter("ok", tenant="a/b", config_json=config_json, model_safetensors=model_st), 400, "invalid_name"),
    }


def _path_cases(allowed_root: Path, outside: Path):
    (allowed_root / "link-out").symlink_to(outside / "adapter", target_is_directory=True)
    sneaky = allowed_root / "sneaky"
    sneaky.mkdir()
    shutil.copy(outside / "adapter" / "adapter_config.json", sneaky / "adapter_config.json")
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter" / "adapter_model.safetensors")
    pickled = allowed_root / "pickled"
    pickled.mkdir()
    shutil.copy(outside / "adapter" / "adapter_config.json", pickled / "adapter_config.json")
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"w": 1}))
    big = allowed_root / "big"
    big.mkdir()
    shutil.copy(outside / "adapter" / "adapter_config.json", big / "adapter_config.json")
    with open(big / "adapter_model.safetensors", "wb") as f:
        f.truncate(3 * 2**20)
    return {
        "dot-dot": ("../outside/adapter", 400, "invalid_path"),
        "dot-dot inside": ("pickled/../../outside/adapter", 400, "invalid_path"),
        "absolute outside": (str(outside / "adapter"), 400, "invalid_path"),
        "url-encoded traversal": ("%2e%2e/outside/adapter", 400, "invalid_path"),
        "symlinked folder out of the root": ("link-out", 400, "invalid_path"),
        "symlinked file out of the root": ("sneaky", 400, "invalid_path"),
        "pickle-only folder": ("pickled", 400, "pickle_refused"),
        "oversize file": ("big", 413, "adapter_too_large"),
        "a file, not a folder": ("pickled/adapter_config.json", 400, "invalid_path"),
        "missing": ("nothing-here", 400, "invalid_path"),
        "empty": ("", 400, "invalid_path"),
    }


def _nothing_stored(store, redis_server):
    assert list((store.data_dir / "blobs").iterdir()) == []
    assert redis_server.client().keys("loraplex:adapter:*") == []
    assert redis_server.client().keys("loraplex:names:*") == []


def test_hostile_uploads_are_refused_and_nothing_is_stored(store, store_client, redis_server, tiny_adapter_dirs, tmp_path):
    marker = tmp_path / "pwned"
    for label, (msg, status, code) in _upload_cases(tiny_adapter_dirs[0], marker).items():
        with pytest.raises(StoreCallError) as err:
            store_client.call(msg)
        assert (err.value.error.status, err.value.error.code) == (status, code), label
        assert err.value.error.message, label
    assert not marker.exists()
    _nothing_stored(store, redis_server)
    assert store_client.call(ListAdapters()).cards == []


def test_hostile_server_paths_are_refused_and_nothing_is_stored(store, store_client, redis_server, allowed_root, tiny_adapter_dirs, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(tiny_adapter_dirs[0], outside / "adapter")
    for label, (path, status, code) in _path_cases(allowed_root, outside).items():
        with pytest.raises(StoreCallError) as err:
            store_client.call(RegisterAdapter("ok", path=path))
        assert (err.value.error.status, err.value.error.code) == (status, code), label
        assert err.value.error.param == "path", label
    _nothing_stored(store, redis_server)


def test_registration_from_a_folder_under_the_allowed_root(store_client, allowed_root, tiny_adapter_dirs):
    shutil.copytree(tiny_adapter_dirs[1], allowed_root / "team" / "bot")
    # A symlink that stays inside the root is fine.
    (allowed_root / "alias").symlink_to(allowed_root / "team" / "bot", target_is_directory=True)
    by_relative = store_client.call(RegisterAdapter("bot", path="team/bot"))
    assert by_relative.created and by_relative.card.rank == 16
    config_json, model_st = adapter_files(tiny_adapter_dirs[1])
    uploaded = store_client.call(RegisterAdapter("bot", config_json=config_json, model_safetensors=model_st))
    assert not uploaded.created and uploaded.card.id == by_relative.card.id
    assert store_client.call(RegisterAdapter("bot2", path=str(allowed_root / "alias"))).card.sha256 == by_relative.card.sha256


def test_path_registration_is_off_without_an_allowed_root(store_factory, tiny_adapter_dirs):
    store = store_factory(allowed_root="")
    client = store.client()
    with pytest.raises(StoreCallError) as err:
        client.call(RegisterAdapter("x", path=str(tiny_adapter_dirs[0])))
    assert err.value.error.code == "path_registration_disabled"
    with pytest.raises(StoreCallError):
        client.call(GetAdapter("x"))
    client.close()
