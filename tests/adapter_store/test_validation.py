"""Input checks in isolation: names, server paths, content, canonical config."""
from __future__ import annotations

import pytest

from services.adapter_store.errors import StoreRefusal
from services.adapter_store.validation import (
    canonical_config, check_content, check_name, check_tenant, looks_like_pickle, resolve_under_root,
)
from shared.model_config import ModelConfig

from .conftest import adapter_files


@pytest.mark.parametrize("name", ["a", "0", "llama-3.1_support.v2", "a" * 64, "x.y-z_1"])
def test_names_that_are_accepted(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "A", "-a", ".a", "_a", "a" * 65, "a/b", "a\\b", "..", "a b", "a:b", "é", None, 5])
def test_names_that_are_refused(name):
    with pytest.raises(StoreRefusal) as err:
        check_name(name)
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_name", "name")


def test_the_empty_tenant_is_the_shared_namespace():
    assert check_tenant("") == ""
    assert check_tenant("acme") == "acme"
    with pytest.raises(StoreRefusal, match="tenant must match"):
        check_tenant("Acme")


def test_rank_above_the_servers_max_is_refused(tiny_adapter_dirs, tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    config_json, model_st = adapter_files(tiny_adapter_dirs[3])  # rank 32
    assert check_content(config_json, model_st, cfg, max_rank=32).rank == 32
    with pytest.raises(StoreRefusal, match="max rank 16") as err:
        check_content(config_json, model_st, cfg, max_rank=16)
    assert err.value.code == "invalid_adapter"


def test_canonical_config_ignores_formatting_and_refuses_nan():
    assert canonical_config(b'{ "r": 8,\n "a": [1, 2] }') == canonical_config(b'{"a":[1,2],"r":8}') == b'{"a":[1,2],"r":8}'
    with pytest.raises(StoreRefusal, match="NaN"):
        canonical_config(b'{"lora_alpha": NaN}')


def test_pickle_sniffing_does_not_mistake_safetensors(tiny_adapter_dirs):
    import pickle

    _, model_st = adapter_files(tiny_adapter_dirs[0])
    assert not looks_like_pickle(model_st)
    header_len_starting_0x80 = (0x180).to_bytes(8, "little") + b"{" + b" " * 0x17F
    assert not looks_like_pickle(header_len_starting_0x80)
    assert all(looks_like_pickle(pickle.dumps({"w": 1}, protocol=p)) for p in (2, 3, 4, 5))


def test_server_paths_resolve_inside_the_root_only(tmp_path):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (root / "a" / "up").symlink_to(tmp_path / "out", target_is_directory=True)
    assert resolve_under_root("a/b", str(root)) == (root / "a" / "b").resolve()
    assert resolve_under_root(str(root / "a" / "b"), str(root)) == (root / "a" / "b").resolve()
    for bad in ("a/../../out", "a/up", str(tmp_path / "out"), "a/b\x00", "/"):
        with pytest.raises(StoreRefusal) as err:
            resolve_under_root(bad, str(root))
        assert err.value.code == "invalid_path", bad
    with pytest.raises(StoreRefusal) as err:
        resolve_under_root("a/b", "")
    assert err.value.code == "path_registration_disabled"
