"""API keys: an admin key for adapter management, tenant keys for inference.

With no keys configured every caller is the admin of the shared namespace (a local, single-user server).
Keys are compared in constant time against every configured key (no early exit that would tell how many
leading characters matched, or which key list was hit) and are never logged: only the tenant name is.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from services.gateway.errors import ApiError

ADMIN = "admin"
TENANT = "tenant"


@dataclass(frozen=True)
class Caller:
    role: str  # ADMIN or TENANT
    tenant: str  # namespace for inference and /v1/models; "" = shared adapters only

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


OPEN_ACCESS = Caller(ADMIN, "")


class ApiKeys:
    def __init__(self, admin_keys: list[str], tenant_keys: dict[str, str]):
        """`tenant_keys` maps key -> tenant name."""
        self._entries: list[tuple[bytes, Caller]] = [(k.encode(), Caller(ADMIN, "")) for k in admin_keys]
        self._entries += [(k.encode(), Caller(TENANT, t)) for k, t in tenant_keys.items()]
        for key, _ in self._entries:
            if len(key) < 16:
                raise ValueError("every API key must be at least 16 characters long")

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """JSON: {"admin_keys": ["..."], "tenants": {"tenant-name": ["key", ...]}}."""
        if not path:
            return cls([], {})
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or set(data) - {"admin_keys", "tenants"}:
            raise ValueError(f"{path}: expected an object with admin_keys and tenants")
        admin = data.get("admin_keys", [])
        tenants = data.get("tenants", {})
        if not isinstance(admin, list) or not all(isinstance(k, str) for k in admin):
            raise ValueError(f"{path}: admin_keys must be a list of strings")
        if not isinstance(tenants, dict):
            raise ValueError(f"{path}: tenants must map a tenant name to a list of keys")
        by_key: dict[str, str] = {}
        for tenant, keys in tenants.items():
            if not tenant or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError(f"{path}: tenant {tenant!r} must have a list of string keys")
            for key in keys:
                by_key[key] = tenant
        return cls(admin, by_key)

    def caller(self, authorization: str | None) -> Caller:
        """Who is calling, from the Authorization header; 401 when keys are on and none matches."""
        if not self.enabled:
            return OPEN_ACCESS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>", None, "invalid_api_key")
        presented = token.strip().encode()
        found = None
        for key, caller in self._entries:
            if hmac.compare_digest(key, presented) and found is None:
                found = caller
        if found is None:
            raise ApiError(401, "invalid API key", None, "invalid_api_key")
        return found


def require_admin(caller: Caller) -> None:
    if not caller.is_admin:
        raise ApiError(403, "adapter management needs the admin key", None, "permission_denied")
