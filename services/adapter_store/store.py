"""The adapter store's behaviour, independent of sockets: register, look up, delete, acquire, release, warm.

Order of effects is what makes a crash harmless:
- register: validate everything -> blob written atomically -> registry entry (one Lua script). A crash
  between the two leaves an orphan blob, which the startup reconciler removes; never an entry without a blob.
  The reading, hashing, checking and storing run on a pool thread (prepare_registration), several
  registrations at once; the loop only lays the new adapter into the arena and answers
  (finish_registration). A content already checked under this base model is not checked again, and its
  blob is not written again (contents.py): a new name for it costs one read and one hash. Such a name is
  not laid into the arena at registration (its rows would come from the blob anyway); its first acquire
  loads it.
- delete: the name is unlisted at once (new lookups get 404); the entry and its arena rows go when the last
  pin is released (in-flight requests finish first); the blob goes when no entry refers to it any more.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from services.gpu_worker.adapter_layout import PackedAdapter, pack_adapter, packed_nbytes
from shared.adapter_format import adapter_from_tensors
from shared.log import get_logger
from shared.model_config import MODULES, ModelConfig
from shared.wire import (
    Ack, AcquireAdapter, AdapterCard, AdapterDeleted, AdapterList, AdapterLocation, AdapterRegistered,
    DeleteAdapter, GetAdapter, ListAdapters, RegisterAdapter, ReleaseAdapter, ReleaseWorker, WarmAdapters, adapter_id,
)

from .arena import Arena, ArenaFull, ArenaTooSmall
from .blob_tensors import stored_tensors
from .blobs import BlobStore, pair_hasher
from .config import StoreConfig
from .contents import BlobGone, ContentFacts, ContentTable, check_fingerprint
from .errors import StoreRefusal, bad_request, not_found
from .offload import Join, Offloaded
from .packed_rows import PackedRows
from .packed_rows import drop_all as drop_packed_rows
from .read_buffers import ReadBuffers
from .registry import RegisterResult, Registry
from .validation import (
    CheckedAdapter, canonical_config, check_content, check_name, check_tenant, check_upload_size, read_adapter_dir,
    resolve_under_root,
)

log = get_logger("adapter_store")
# The `loading` key of acquires waiting for a load thread (no adapter id is empty).
LOAD_QUEUE = ""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextmanager
def arena_refusals() -> Iterator[None]:
    """The arena's refusals as the store's 507 answers: too small ever, or full for now (every byte pinned
    or being loaded: workers ask again shortly)."""
    try:
        yield
    except ArenaTooSmall as e:
        raise StoreRefusal(507, "arena_too_small", str(e), "adapter") from None
    except ArenaFull as e:
        raise StoreRefusal(507, "arena_full", str(e), "adapter") from None


def engine_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class PreparedRegistration:
    """What a pool thread hands the loop: the registry's answer, or the name's current entry when the
    name was taken, and the rows to lay into the arena when the content was checked just now."""

    aid: str
    result: RegisterResult | None = None
    taken_by: AdapterCard | None = None
    packed: PackedAdapter | None = None


def _content_hasher(config_json: bytes):
    """The pair hash of an adapter whose config is this, or None when the config is not valid JSON (the
    content checks then refuse it with their own message)."""
    try:
        return pair_hasher(canonical_config(config_json))
    except StoreRefusal:
        return None


class AdapterStore:
    def __init__(self, cfg: StoreConfig, registry: Registry, blobs: BlobStore, arena: Arena, model: ModelConfig):
        self.cfg = cfg
        self.registry = registry
        self.blobs = blobs
        self.contents = ContentTable(blobs, check_fingerprint(model, cfg.max_rank), registry.blob_refs)
        self.arena = arena
        self.model = model
        self.dtype = engine_dtype(cfg.dtype)
        self.slot_width = model.kv_dim
        self.deleting: set[str] = set()  # unlisted ids whose rows are still pinned
        # Hinted adapters to load while idle, each with the more urgent hints it must not evict.
        self.warm_queue: deque[tuple[str, frozenset[str]]] = deque()
        # Adapters being read from disk for an acquire or a hint -> the callers of acquires that arrived
        # meanwhile (opaque to the store: the service answers them once the read is laid in).
        self.loading: dict[str, list] = {}
        # Acquires reading from disk now: at most one per load thread holds an arena range, so that queued
        # loads do not evict cached adapters long before their bytes come. Further ones wait (LOAD_QUEUE).
        self.reading = 0
        self.blob_reads = 0  # counted on the load threads, under _reads_lock
        self.read_buffers = ReadBuffers()  # each load thread's blob buffer, reused read after read
        # Contents' rows in the arena's layout on disk: a load from disk is then one read, no repack.
        self.packed = (PackedRows(cfg.data_dir, self.dtype, self.slot_width, self.contents.fingerprint,
                                  int(cfg.packed_rows_min_free_gb * 1e9)) if cfg.packed_rows else None)
        self.packed_reads = 0  # loads served from packed rows, counted under _reads_lock
        self._reads_lock = threading.Lock()

    # ------------------------------------------------------------------ startup
    def reconcile(self) -> dict[str, int]:
        """Bring disk and registry back into agreement after a crash; runs before any request is served."""
        temp = self.blobs.remove_temp_files()
        purged = 0
        # No pin survives a restart, so deletions that waited for one can finish now.
        for aid in self.registry.deleting_ids():
            purged += 1
            self._purge(aid)
        referenced = self.registry.referenced_blobs()
        orphans = [sha for sha in self.blobs.list() if sha not in referenced]
        for sha in orphans:
            self.blobs.delete(sha)
        if self.packed is not None:
            self.packed.keep_only(referenced)
        else:
            drop_packed_rows(self.cfg.data_dir)
        missing = sorted(sha for sha in referenced if not self.blobs.exists(sha))
        for sha in missing:
            log.error("registry_entry_without_blob", sha256=sha)
        # Contents checked under this same model, limit and code need no check when registered again.
        known = self.registry.checked_under(self.contents.fingerprint)
        for card in known:
            self.contents.remember(card.sha256, ContentFacts(card.rank, tuple(card.target_modules)))
        counts = {"temp_files": temp, "purged": purged, "orphan_blobs": len(orphans), "missing_blobs": len(missing),
                  "checked_contents": len({c.sha256 for c in known})}
        log.info("reconciled", **counts)
        return counts

    # ------------------------------------------------------------------ management
    def register(self, msg: RegisterAdapter) -> Offloaded:
        return Offloaded(lambda: self.prepare_registration(msg), lambda prepared: self.finish_registration(prepared, msg.call_id))

    def prepare_registration(self, msg: RegisterAdapter, read_all: bool = False) -> PreparedRegistration:
        """On a pool thread: every check, the blob and the registry entry. Touches neither the arena nor
        the loop's tables; safe to run for many registrations at once. A path whose content passed its
        checks and is stored already is only hashed (read_all=False), never copied into memory: bulk
        registration of many names for few weight sets then costs a hash pass per name."""
        name = check_name(msg.name)
        tenant = check_tenant(msg.tenant)
        # Where a registration's time goes, in its log line: reading and hashing, the content checks, then
        # the blob and the registry's durable writes (bulk registration rates depend on which dominates).
        t0 = time.monotonic()
        # A content seen for the first time is hashed twice (once here, once as it is read for its checks): a
        # hash pass costs far less than the copy and checks a known content is spared.
        known = None if read_all else self._hashed_known(msg)
        if known is not None:
            config_json, model_size, sha, facts = known
            model_st, checked = None, None
        else:
            config_json, model_st, sha = self._read_hashed(msg)
            model_size = len(model_st)
        t1 = time.monotonic()
        if known is None:
            facts, checked = self._checked(sha, config_json, model_st)
        t2 = time.monotonic()
        aid = adapter_id(tenant, name, sha)

        # Answer duplicates before writing anything: a 409 must leave the store exactly as it was.
        current = self.registry.lookup_own(tenant, name)
        if current is not None:
            return PreparedRegistration(aid, taken_by=current)

        canonical = canonical_config(config_json)
        card = AdapterCard(id=aid, name=name, tenant=tenant, rank=facts.rank, target_modules=list(facts.target_modules),
                           sha256=sha, bytes=len(canonical) + model_size, created=time.time(), status="ready")
        try:
            wrote = self.contents.hold(sha, canonical, model_st)
        except BlobGone:  # deleted since it was seen: read the bytes to store it again
            return self.prepare_registration(msg, read_all=True)
        try:
            result = self.registry.register(card, checked_for=self.contents.fingerprint)
        finally:
            self.contents.release(sha)
        if result.outcome != "created":
            if wrote:  # the name was taken meanwhile: the blob this call wrote may be nobody's
                self.contents.delete_blob(sha)
            return PreparedRegistration(aid, result=result)
        log.info("adapter_registered", adapter=aid, tenant=tenant, rank=card.rank, bytes=card.bytes,
                 checked=checked is not None, hashed_only=known is not None, blob_written=wrote, read_s=round(t1 - t0, 4),
                 check_s=round(t2 - t1, 4), store_s=round(time.monotonic() - t2, 4))
        packed = None
        if checked is not None:  # lay it out for the workers: the first request that uses it needs no disk read
            checked.weights.name = aid
            packed = pack_adapter(checked.weights, self.model, self.slot_width, self.dtype)
            if self.packed is not None:  # and on disk: its first load from disk is one read as well
                self.packed.write(sha, packed)
        return PreparedRegistration(aid, result=result, packed=packed)

    def _hashed_known(self, msg: RegisterAdapter) -> tuple[bytes, int, str, ContentFacts] | None:
        """For a path registration whose content passed its checks under this model and is stored: its config,
        model file size, sha256 and facts, from one hash pass; None otherwise (the caller reads it all)."""
        if msg.path is None or msg.config_json is not None or msg.model_safetensors is not None:
            return None
        folder = resolve_under_root(msg.path, self.cfg.allowed_root)
        config_json, model_size, hasher = read_adapter_dir(folder, self.cfg.allowed_root, self.cfg.max_upload_bytes,
                                                           _content_hasher, keep=False)
        if hasher is None:
            return None
        sha = hasher.hexdigest()
        facts = self.contents.facts(sha)
        if facts is None or not self.blobs.exists(sha):
            return None
        return config_json, model_size, sha, facts  # the read kept config + model under the upload limit

    def _read_hashed(self, msg: RegisterAdapter) -> tuple[bytes, bytes | bytearray, str]:
        """The adapter's two files, from the message or read from its folder, and their sha256."""
        limit = self.cfg.max_upload_bytes
        if msg.path is not None:
            if msg.config_json is not None or msg.model_safetensors is not None:
                raise bad_request("invalid_request", "give either uploaded files or a server path, not both", "path")
            folder = resolve_under_root(msg.path, self.cfg.allowed_root)
            # Hashed in the same pass as it is read.
            config_json, model_st, hasher = read_adapter_dir(folder, self.cfg.allowed_root, limit, _content_hasher)
            check_upload_size(config_json, model_st, limit)
        else:
            if msg.config_json is None:
                raise bad_request("missing_file", "adapter_config (adapter_config.json) is required", "adapter_config")
            if msg.model_safetensors is None:
                raise bad_request("missing_file", "adapter_model (adapter_model.safetensors) is required", "adapter_model")
            config_json, model_st = msg.config_json, msg.model_safetensors
            check_upload_size(config_json, model_st, limit)
            hasher = _content_hasher(config_json)
            if hasher is not None:
                hasher.update(model_st)
        if hasher is None:  # the config is not JSON: the checks name the first problem (a pickle, or the config)
            check_content(config_json, model_st, self.model, self.cfg.max_rank)
            canonical_config(config_json)  # not reached: check_content has refused the config already
        return config_json, model_st, hasher.hexdigest()

    def _checked(self, sha: str, config_json: bytes, model_st: bytes | bytearray) -> tuple[ContentFacts, CheckedAdapter | None]:
        """The content's facts, and its parsed weights when its checks ran here (None when this content had
        passed them before, under this model)."""
        checked: list[CheckedAdapter] = []

        def check() -> ContentFacts:
            checked.append(check_content(config_json, model_st, self.model, self.cfg.max_rank))
            return ContentFacts(checked[0].rank, tuple(checked[0].target_modules))

        facts = self.contents.checked(sha, check)
        return facts, (checked[0] if checked else None)

    def finish_registration(self, prepared: PreparedRegistration, call_id: str) -> AdapterRegistered:
        """On the loop: the answer, after laying fresh rows into the arena."""
        if prepared.taken_by is not None:
            return self._existing(prepared.taken_by, prepared.aid, call_id)
        result = prepared.result
        if result.outcome != "created":
            return self._existing(result.card, prepared.aid, call_id)
        self.deleting.discard(prepared.aid)
        if prepared.packed is not None:
            try:
                self.arena.put(prepared.aid, prepared.packed)
            except ArenaFull as e:
                log.info("arena_skip_on_register", adapter=prepared.aid, reason=str(e))
        return AdapterRegistered(self._with_residency(result.card), created=True, call_id=call_id)

    def _existing(self, current: AdapterCard | None, aid: str, call_id: str) -> AdapterRegistered:
        if current is None or current.id != aid:
            raise StoreRefusal(409, "adapter_exists", f"adapter {current.name if current else ''!r} already exists "
                               "with other content; delete it first or choose another name", "name")
        return AdapterRegistered(self._with_residency(current), created=False, call_id=call_id)

    def get(self, msg: GetAdapter) -> AdapterCard:
        card = self.registry.lookup(check_tenant(msg.tenant), check_name(msg.name))
        if card is None:
            raise not_found(msg.name)
        card = self._with_residency(card)
        card.call_id = msg.call_id
        return card

    def list(self, msg: ListAdapters) -> AdapterList:
        cards = self.registry.list(check_tenant(msg.tenant), all_tenants=msg.all_tenants)
        return AdapterList([self._with_residency(c) for c in cards], call_id=msg.call_id)

    def delete(self, msg: DeleteAdapter) -> AdapterDeleted:
        tenant, name = check_tenant(msg.tenant), check_name(msg.name)
        aid = self.registry.mark_deleted(tenant, name)
        if aid is None:
            raise not_found(name)
        log.info("adapter_unlisted", adapter=aid, tenant=tenant)
        self.deleting.add(aid)
        self._finish_delete_if_unpinned(aid)
        return AdapterDeleted(name, tenant, call_id=msg.call_id)

    def _finish_delete_if_unpinned(self, aid: str) -> None:
        if self.arena.drop(aid):
            self.deleting.discard(aid)
            self._purge(aid)

    def _purge(self, aid: str) -> None:
        card = self.registry.by_id(aid)
        remaining = self.registry.purge(aid)
        dropped = remaining == 0 and card is not None and self.contents.delete_blob(card.sha256)
        if dropped and self.packed is not None:
            self.packed.delete(card.sha256)
        if remaining >= 0:
            log.info("adapter_deleted", adapter=aid, blob_dropped=dropped)

    def _with_residency(self, card: AdapterCard) -> AdapterCard:
        card.host_resident = card.id in self.arena
        return card

    # ------------------------------------------------------------------ workers
    def acquire(self, msg: AcquireAdapter) -> AdapterLocation | Offloaded | Join:
        """Pin an adapter for a worker. One in the arena is answered at once; one that must come from disk
        gets its arena range on the loop (evicting as needed, or refused at once when pins leave no room:
        the worker asks again shortly), then a load thread reads, checks and packs it straight into that
        range (a 60 MB adapter takes a good fraction of a second; the loop goes on answering meanwhile),
        and the loop pins it. One already being read joins that read."""
        if self.arena.get(msg.adapter) is not None:
            return self._pin_for(msg)
        aid = msg.adapter
        if aid in self.loading:
            return Join(aid)
        if self.reading >= self.cfg.load_threads:
            return Join(LOAD_QUEUE)  # asked again, in order, as each read ends
        card = self.registry.by_id(aid)
        if card is None:
            raise not_found(aid, "adapter")
        # Module ranks from the card (exact unless ranks vary by layer; then the rows are laid in on the loop).
        ranks = tuple(card.rank if m in card.target_modules else 0 for m in MODULES)
        with arena_refusals():
            dest = self.arena.reserve(aid, packed_nbytes(ranks, self.model, self.slot_width, self.dtype))
        self.loading[aid] = []
        self.reading += 1
        return Offloaded(lambda: self._load_into(aid, dest), lambda loaded: self._finish_acquire(msg, loaded),
                         pool="load", reads=(aid, LOAD_QUEUE))

    def _load_into(self, aid: str, dest) -> tuple[PackedAdapter, bool] | Exception:
        """On a load thread: the adapter packed into its reserved range (True), or into memory of its own
        when its size differs from the card's estimate (False); a failure is returned, for the loop to give
        the range back before it answers."""
        try:
            return self._rows_from_disk(aid, dest)
        except Exception as e:
            return e

    def _finish_acquire(self, msg: AcquireAdapter, loaded) -> AdapterLocation:
        self.reading -= 1
        aid = msg.adapter
        if isinstance(loaded, Exception) or aid in self.arena or self.registry.by_id(aid) is None:
            # Failed, laid in meanwhile by a hint's read, or deleted while it was read.
            self.arena.unreserve(aid)
            if isinstance(loaded, Exception):
                raise loaded
            if aid not in self.arena:
                raise not_found(aid, "adapter")
            return self._pin_for(msg)
        packed, in_place = loaded
        if in_place:
            self.arena.commit(aid, packed.rows.dtype, tuple(packed.rows.shape), packed.ranks, packed.a_off,
                              packed.b_off)
            log.info("adapter_loaded", adapter=aid, bytes=packed.nbytes)
        else:
            self.arena.unreserve(aid)
            self._put(aid, packed)
        return self._pin_for(msg)

    def settle(self, reads: tuple[str, ...]) -> list:
        """The callers that joined these reads, now that they are over (laid in, or failed)."""
        return [caller for aid in reads for caller in self.loading.pop(aid, [])]

    def _lay_in(self, aid: str, packed, keep: frozenset[str] = frozenset()) -> bool:
        """Lay rows read on the load threads into the arena, unless another load of the same adapter got
        there first; False when the adapter was deleted while they were being read."""
        if aid in self.arena:
            return True
        if self.registry.by_id(aid) is None:
            return False
        self._put(aid, packed, keep)
        return True

    def _pin_for(self, msg: AcquireAdapter) -> AdapterLocation:
        entry = self.arena.acquire(msg.adapter, msg.worker_id)
        return AdapterLocation(
            adapter=msg.adapter, segment=self.arena.name, offset=entry.offset, nbytes=entry.nbytes,
            dtype=entry.dtype, shape=list(entry.shape), ranks=list(entry.ranks), a_off=list(entry.a_off),
            b_off=list(entry.b_off), call_id=msg.call_id,
        )

    def release(self, msg: ReleaseAdapter) -> Ack | None:
        try:
            entry = self.arena.release(msg.adapter, msg.worker_id)
        except KeyError:
            raise StoreRefusal(409, "not_acquired", f"adapter {msg.adapter!r} is not acquired by worker {msg.worker_id!r}", "adapter") from None
        if msg.adapter in self.deleting and not entry.pinned:
            self._finish_delete_if_unpinned(msg.adapter)
        return Ack(msg.call_id) if msg.call_id else None

    def release_worker(self, msg: ReleaseWorker) -> Ack | None:
        """Drop every pin of a worker that died (the launcher restarts it with an empty pool)."""
        held = self.arena.release_worker(msg.worker_id)
        log.info("worker_pins_released", worker=msg.worker_id, adapters=len(held))
        for aid in held:
            if aid in self.deleting:
                self._finish_delete_if_unpinned(aid)
        return Ack(msg.call_id) if msg.call_id else None

    def prepare_load(self, aid: str) -> PackedAdapter:
        """An adapter's rows in the arena's format, in memory of their own (a hint's load). Touches no arena
        state: it runs on the pool."""
        return self._rows_from_disk(aid)[0]

    def _rows_from_disk(self, aid: str, dest=None) -> tuple[PackedAdapter, bool]:
        """An adapter's rows and whether they went into `dest` (a byte range exactly their size), else into
        memory of their own: one read of its packed rows file when there is one, else its blob read,
        checked and packed (and the packed rows kept for the next time)."""
        card = self._card(aid)
        if self.packed is not None:
            read = self.packed.read(card.sha256, aid, dest)
            if read is not None:
                with self._reads_lock:
                    self.blob_reads += 1
                    self.packed_reads += 1
                return read
        weights = self.read_weights(aid, card)
        ranks = tuple(weights.module_rank(m) for m in MODULES)
        in_place = dest is not None and packed_nbytes(ranks, self.model, self.slot_width, self.dtype) == dest.numel()
        packed = pack_adapter(weights, self.model, self.slot_width, self.dtype, out=dest if in_place else None)
        if self.packed is not None:
            self.packed.write(card.sha256, packed)
        return packed, in_place

    def _card(self, aid: str) -> AdapterCard:
        card = self.registry.by_id(aid)
        if card is None:
            raise not_found(aid, "adapter")
        return card

    def read_weights(self, aid: str, card: AdapterCard | None = None):
        """An adapter's weights from its stored blob (read from disk). Its tensors are views of this thread's
        read buffer, valid until the thread's next read (every caller packs them at once), and its config,
        keys, shapes and ranks are checked against the model again; the pass over every value for NaN/Inf
        is not repeated (it passed it when stored, and its blob is named by its sha256)."""
        card = card or self._card(aid)
        with self._reads_lock:
            self.blob_reads += 1
        try:
            config_json, model_st = self.blobs.read_view(card.sha256, self.read_buffers.get)
            weights = adapter_from_tensors(config_json, stored_tensors(model_st), self.model, self.cfg.max_rank,
                                           aid, check_values=False)
        except (OSError, ValueError) as e:  # AdapterError and BlobLayoutError are ValueErrors
            log.error("blob_unreadable", adapter=aid, sha256=card.sha256, error=str(e))
            raise StoreRefusal(500, "blob_unreadable", f"stored content of adapter {aid!r} cannot be read") from None
        return weights

    def _put(self, aid: str, packed, keep: frozenset[str] = frozenset()) -> None:
        with arena_refusals():
            self.arena.put(aid, packed, keep=keep)
        log.info("adapter_loaded", adapter=aid, bytes=packed.nbytes)

    def warm(self, msg: WarmAdapters) -> Offloaded | None:
        """Hints in priority order; a load never evicts a more urgent hinted adapter. Without a call_id they
        are queued and loaded one at a time while the store is idle (a newer hint supersedes the previous
        one); with one, they are read on the load threads and laid in, and the Ack comes when that is done.
        Either way the disk reads stay off the loop."""
        plan = [(aid, frozenset(msg.adapters[:i])) for i, aid in enumerate(msg.adapters)
                if aid not in self.arena and aid not in self.loading]
        if not msg.call_id:
            self.warm_queue = deque(plan)
            return None

        def read_all() -> list:
            read = []
            for aid, keep in plan:
                try:
                    read.append((aid, keep, self.prepare_load(aid)))
                except StoreRefusal as e:  # deleted or unreadable meanwhile: a hint, the others still count
                    log.info("warm_skipped", adapter=aid, code=e.code, reason=e.message)
            return read

        def lay_in_all(read: list) -> Ack:
            for aid, keep, packed in read:
                if not self._warm_in(aid, keep, packed):
                    break
            return Ack(msg.call_id)

        # Read one after another on one thread: an acquire of one of them reads it itself rather than wait
        # for the ones before it (so these reads take no joiners).
        return Offloaded(read_all, lay_in_all, pool="load")

    def next_warm(self) -> Offloaded | None:
        """The next queued hint not yet in the arena nor being read, as work for the load threads, or None
        when none is left."""
        while self.warm_queue:
            aid, keep = self.warm_queue.popleft()
            if aid not in self.arena and aid not in self.loading:
                self.loading[aid] = []
                return Offloaded(lambda: self.prepare_load(aid), lambda packed: self._finish_warm(aid, keep, packed),
                                 pool="load", reads=(aid,))
        return None

    def _finish_warm(self, aid: str, keep: frozenset[str], packed) -> None:
        if not self._warm_in(aid, keep, packed):
            self.warm_queue.clear()  # the arena is full of more urgent adapters: the rest of the hint waits

    def _warm_in(self, aid: str, keep: frozenset[str], packed) -> bool:
        """Lay a hinted adapter's rows in; False when the arena has no room left (stop warming)."""
        try:
            self._lay_in(aid, packed, keep)
        except StoreRefusal as e:
            log.info("warm_skipped", adapter=aid, code=e.code, reason=e.message)
            return e.code != "arena_full"
        return True
