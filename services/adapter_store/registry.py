"""The adapter registry in Redis: who registered what under which name, durable and atomic.

Keys (P = key prefix):
    P:adapter:<id>     hash: the card (id, name, tenant, rank, target_modules, sha256, bytes, created, status)
                       and checked_for: the fingerprint its content's checks ran under (contents.py)
    P:names:<tenant>   hash: name -> id of the live registration ("" tenant = shared adapters)
    P:tenants          set of tenants that ever registered (for listing all)
    P:blob:<sha256>    set of ids whose content is that blob (a blob with no id left is garbage)

Every change is one Lua script, which Redis runs atomically and logs to the AOF as one transaction: a
crash leaves either nothing or a whole entry. With appendfsync always, Redis fsyncs the AOF before it
replies, so a registration that returned is on disk (checked at startup).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from shared.wire import AdapterCard

_REGISTER = """
local names, card, blob, tenants = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local name, id, tenant = ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', names, name)
if current then
  if current == id then return {0, current} end
  return {-1, current}
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
if redis.call('EXISTS', card) == 1 then
  -- Same content registered again under this name while its deletion waits for pins: revive it.
  redis.call('HSET', card, 'status', 'ready')
else
  redis.call('HSET', card, unpack(fields))
end
redis.call('HSET', names, name, id)
redis.call('SADD', blob, id)
redis.call('SADD', tenants, tenant)
return {1, id}
"""

_MARK_DELETED = """
local names, prefix, name = KEYS[1], ARGV[1], ARGV[2]
local id = redis.call('HGET', names, name)
if not id then return false end
redis.call('HDEL', names, name)
redis.call('HSET', prefix .. ':adapter:' .. id, 'status', 'deleting')
return id
"""

# Drop a deleting entry for good; returns how many ids still use its blob (0 -> the blob can go), or -1
# when the entry is not (or no longer) deleting.
_PURGE = """
local card, prefix = KEYS[1], ARGV[1]
if redis.call('HGET', card, 'status') ~= 'deleting' then return -1 end
local sha = redis.call('HGET', card, 'sha256')
local id = redis.call('HGET', card, 'id')
redis.call('DEL', card)
local blob = prefix .. ':blob:' .. sha
redis.call('SREM', blob, id)
return redis.call('SCARD', blob)
"""


class RegistryNotDurable(RuntimeError):
    pass


@dataclass
class RegisterResult:
    outcome: str  # "created", "exists" (same content, idempotent), "conflict" (other content)
    card: AdapterCard | None


def _card_from_hash(h: dict[bytes, bytes]) -> AdapterCard:
    s = {k.decode(): v.decode() for k, v in h.items()}
    return AdapterCard(
        id=s["id"], name=s["name"], tenant=s["tenant"], rank=int(s["rank"]),
        target_modules=json.loads(s["target_modules"]), sha256=s["sha256"], bytes=int(s["bytes"]),
        created=float(s["created"]), status=s["status"],
    )


class Registry:
    def __init__(self, url: str, prefix: str = "loraplex"):
        self.redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.prefix = prefix
        self._register = self.redis.register_script(_REGISTER)
        self._mark_deleted = self.redis.register_script(_MARK_DELETED)
        self._purge = self.redis.register_script(_PURGE)

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def check_durable(self) -> None:
        """Refuse to run on a Redis that could lose an acknowledged registration."""
        try:
            cfg = self.redis.config_get("append*")
        except redis.ResponseError as e:
            raise RegistryNotDurable(f"cannot read Redis persistence settings (CONFIG GET refused: {e})") from None
        appendonly = cfg.get("appendonly") or cfg.get(b"appendonly")
        fsync = cfg.get("appendfsync") or cfg.get(b"appendfsync")
        as_text = lambda v: v.decode() if isinstance(v, bytes) else str(v)
        if as_text(appendonly) != "yes" or as_text(fsync) != "always":
            raise RegistryNotDurable(
                f"Redis must run with appendonly yes and appendfsync always (has appendonly {as_text(appendonly)}, "
                f"appendfsync {as_text(fsync)}); start it with --appendonly yes --appendfsync always"
            )

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def wait_until_reachable(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.redis.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis at {self.redis.connection_pool.connection_kwargs.get('host')} "
                                       f"is not reachable: {e}") from None
                time.sleep(0.1)

    def register(self, card: AdapterCard, checked_for: str = "") -> RegisterResult:
        fields = {
            "id": card.id, "name": card.name, "tenant": card.tenant, "rank": str(card.rank),
            "target_modules": json.dumps(card.target_modules), "sha256": card.sha256, "bytes": str(card.bytes),
            "created": repr(card.created or time.time()), "status": "ready", "checked_for": checked_for,
        }
        flat = [x for kv in fields.items() for x in kv]
        code, current = self._register(
            keys=[self._k("names", card.tenant), self._k("adapter", card.id), self._k("blob", card.sha256), self._k("tenants")],
            args=[card.name, card.id, card.tenant, *flat],
        )
        current = current.decode()
        if code == -1:
            return RegisterResult("conflict", self.by_id(current))
        return RegisterResult("created" if code == 1 else "exists", self.by_id(current))

    def by_id(self, adapter_id: str) -> AdapterCard | None:
        h = self.redis.hgetall(self._k("adapter", adapter_id))
        return _card_from_hash(h) if h else None

    def lookup_own(self, tenant: str, name: str) -> AdapterCard | None:
        """The live registration of exactly this tenant's name (no fallback to shared adapters)."""
        adapter_id = self.redis.hget(self._k("names", tenant), name)
        return self.by_id(adapter_id.decode()) if adapter_id is not None else None

    def lookup(self, tenant: str, name: str) -> AdapterCard | None:
        """A live registration of this tenant's name, falling back to the shared one."""
        for owner in ([tenant, ""] if tenant else [""]):
            adapter_id = self.redis.hget(self._k("names", owner), name)
            if adapter_id is not None:
                card = self.by_id(adapter_id.decode())
                if card is not None:
                    return card
        return None

    def list(self, tenant: str, all_tenants: bool = False) -> list[AdapterCard]:
        if all_tenants:
            owners = sorted({t.decode() for t in self.redis.smembers(self._k("tenants"))} | {""})
        else:
            owners = [tenant, ""] if tenant else [""]
        ids = []
        for owner in owners:
            ids += [v.decode() for v in self.redis.hvals(self._k("names", owner))]
        cards = [_card_from_hash(h) for h in self._hashes([self._k("adapter", i) for i in ids]) if h]
        return sorted(cards, key=lambda c: (c.tenant, c.name))

    def _hashes(self, keys: list[str], batch: int = 1000) -> list[dict[bytes, bytes]]:
        """HGETALL of many keys in few round trips (thousands of adapters list in milliseconds)."""
        out = []
        for i in range(0, len(keys), batch):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys[i:i + batch]:
                pipe.hgetall(key)
            out += pipe.execute()
        return out

    def blob_refs(self, sha256: str) -> int:
        """How many entries (live or deleting) point at this blob."""
        return int(self.redis.scard(self._k("blob", sha256)))

    def mark_deleted(self, tenant: str, name: str) -> str | None:
        """Unlist a name (new requests get 404); the entry stays, status deleting, until purged."""
        adapter_id = self._mark_deleted(keys=[self._k("names", tenant)], args=[self.prefix, name])
        return adapter_id.decode() if adapter_id else None

    def purge(self, adapter_id: str) -> int:
        """Remove a deleting entry; returns the ids still referencing its blob, -1 if not deleting."""
        return int(self._purge(keys=[self._k("adapter", adapter_id)], args=[self.prefix]))

    def deleting_ids(self) -> list[str]:
        return [c.id for c in self._all_cards() if c.status == "deleting"]

    def referenced_blobs(self) -> set[str]:
        """sha256 of every blob some entry (live or deleting) still points at."""
        return {c.sha256 for c in self._all_cards()}

    def checked_under(self, fingerprint: str) -> list[AdapterCard]:
        """Entries whose content passed its checks under this fingerprint."""
        return [_card_from_hash(h) for h in self._all_hashes() if h.get(b"checked_for", b"").decode() == fingerprint]

    def _all_cards(self) -> list[AdapterCard]:
        return [_card_from_hash(h) for h in self._all_hashes()]

    def _all_hashes(self) -> list[dict[bytes, bytes]]:
        keys = [k.decode() for k in self.redis.scan_iter(match=self._k("adapter", "*"), count=1000)]
        return [h for h in self._hashes(keys) if h]
