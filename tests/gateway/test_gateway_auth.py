"""API keys over HTTP: admin manages adapters, tenants infer within their namespace, keys never logged."""
import json

import httpx
import pytest

from tests.gateway.peers import GatewayProcess, card

ADMIN = "admin-secret-000000000001"
ACME = "acme-secret-0000000000002"
GLOBEX = "globex-secret-00000000003"


@pytest.fixture(scope="module")
def secured(peers, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secured")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"admin_keys": [ADMIN], "tenants": {"acme": [ACME], "globex": [GLOBEX]}}))
    gw = GatewayProcess(folder, tiny_model_dir, peers, api_keys_file=keys, max_model_len=64)
    gw.wait_ready()
    yield gw
    gw.stop()


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_no_key_or_a_wrong_key_is_401(secured, peers):
    for headers in ({}, auth("not-a-key-at-all-000000")):
        r = httpx.post(secured.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(secured.url + "/v1/models", headers=headers).status_code == 401
    assert peers.submits == []
    assert httpx.get(secured.url + "/health").status_code == 200  # probes need no key


def test_tenant_key_cannot_manage_adapters(secured, peers):
    r = httpx.post(secured.url + "/v1/adapters", json={"name": "x", "path": "/srv/x"}, headers=auth(ACME))
    assert r.status_code == 403
    assert httpx.delete(secured.url + "/v1/adapters/x", headers=auth(ACME)).status_code == 403
    assert httpx.get(secured.url + "/v1/adapters", headers=auth(ACME)).status_code == 403
    assert not any(type(c).__name__ in ("RegisterAdapter", "DeleteAdapter") for c in peers.store_calls)
    r = httpx.post(secured.url + "/v1/adapters", json={"name": "x", "path": "/srv/x", "tenant": "acme"}, headers=auth(ADMIN))
    assert r.status_code == 201 and r.json()["tenant"] == "acme"


def test_tenants_see_and_use_only_their_own_and_shared_adapters(secured, peers):
    peers.cards[("acme", "acme-private")] = card("acme-private", tenant="acme")
    peers.cards[("", "shared")] = card("shared")
    acme_models = {m["id"] for m in httpx.get(secured.url + "/v1/models", headers=auth(ACME)).json()["data"]}
    globex_models = {m["id"] for m in httpx.get(secured.url + "/v1/models", headers=auth(GLOBEX)).json()["data"]}
    assert acme_models == {"tiny", "acme-private", "shared"} and globex_models == {"tiny", "shared"}
    r = httpx.post(secured.url + "/v1/completions", json={"model": "acme-private", "prompt": "x", "max_tokens": 2}, headers=auth(ACME))
    assert r.status_code == 200
    assert (peers.submits[-1].tenant, peers.submits[-1].adapter) == ("acme", "acme:acme-private@0123456789abcdef")
    # Another tenant's adapter does not exist for globex: 404, as for a name nobody registered.
    r = httpx.post(secured.url + "/v1/completions", json={"model": "acme-private", "prompt": "x"}, headers=auth(GLOBEX))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(peers.submits) == 1


def test_keys_never_reach_the_log(secured):
    httpx.post(secured.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth(ACME))
    httpx.get(secured.url + "/v1/models", headers=auth("wrong-key-000000000000000"))
    log = secured.log_path.read_text()
    assert log and ACME not in log and ADMIN not in log and "wrong-key" not in log
