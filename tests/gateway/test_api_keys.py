import json

import pytest

from services.gateway.auth import ApiKeys, require_admin
from services.gateway.errors import ApiError

ADMIN = "admin-key-0123456789"
ACME = "acme-key-0123456789ab"


def keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"admin_keys": [ADMIN], "tenants": {"acme": [ACME]}}))
    return ApiKeys.from_file(str(path))


def test_no_keys_means_open_admin_access():
    caller = ApiKeys([], {}).caller(None)
    assert caller.is_admin and caller.tenant == ""


def test_keys_identify_admin_and_tenant(tmp_path):
    k = keys(tmp_path)
    assert k.caller(f"Bearer {ADMIN}").is_admin
    acme = k.caller(f"bearer {ACME}")
    assert (acme.is_admin, acme.tenant) == (False, "acme")
    with pytest.raises(ApiError) as info:
        require_admin(acme)
    assert info.value.status == 403


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", f"Bearer {ADMIN}x", f"Bearer {ADMIN[:-1]}"])
def test_missing_or_wrong_key_is_401(tmp_path, header):
    with pytest.raises(ApiError) as info:
        keys(tmp_path).caller(header)
    assert info.value.status == 401
    assert ADMIN not in info.value.message


def test_bad_key_files_are_refused(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"admin_keys": ["short"]}))
    with pytest.raises(ValueError, match="at least 16"):
        ApiKeys.from_file(str(path))
    path.write_text(json.dumps({"admins": []}))
    with pytest.raises(ValueError, match="expected an object"):
        ApiKeys.from_file(str(path))
