"""What the store knows about adapter contents (by sha256), shared by the registrations running at once.

- Checked contents. Every content check (pickle, config, safetensors, shapes against the base model, rank
  limit, finite values) is a function of the content bytes, the base model's geometry, the rank limit and
  the rules' code alone. The sha256 names the bytes (canonical config included) and the fingerprint names
  the rest, so a content that passed under this fingerprint passes again: later names with the same
  sha256 (hard-linked copies of one adapter, say) skip the checks. Name, tenant, path and size checks
  still run for every registration. Registry entries record the fingerprint they were checked under, so
  a restart with the same model and code keeps what it knew.
- One check per content at a time: a registration whose content is being checked by another waits for
  that answer (a bad content is refused to both with the same error).
- Holds: a blob a registration is about to point at cannot be deleted underneath it. A blob is deleted
  only while no registration holds it and, checked under the same lock, no registry entry points at it;
  a registration that finds its blob gone writes it again from the bytes it has just hashed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shared import adapter_format, model_config
from shared.model_config import ModelConfig

from . import validation
from .blobs import BlobStore

# Bounds memory, not correctness: a forgotten content is checked again the next time it comes.
MAX_REMEMBERED = 1 << 16


@dataclass(frozen=True)
class ContentFacts:
    """What the checks found in one content, all a registration needs for its card."""

    rank: int
    target_modules: tuple[str, ...]


def check_fingerprint(model: ModelConfig, max_rank: int) -> str:
    """Names everything besides the bytes that a content check depends on: the base model's geometry, the
    rank limit, and the source of the checks themselves (a changed rule means checking again)."""
    h = hashlib.sha256(json.dumps({"model": dataclasses.asdict(model), "max_rank": max_rank},
                                  sort_keys=True, default=str).encode())
    for module in (adapter_format, model_config, validation):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:32]


class BlobGone(Exception):
    """The blob of a content a registration only hashed is not stored (deleted meanwhile): read its bytes."""


class _Hold:
    __slots__ = ("count", "write_lock")

    def __init__(self):
        self.count = 0
        self.write_lock = threading.Lock()


class ContentTable:
    def __init__(self, blobs: BlobStore, fingerprint: str, references: Callable[[str], int]):
        self.blobs = blobs
        self.fingerprint = fingerprint
        self.references = references  # registry entries pointing at a blob (Registry.blob_refs)
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, ContentFacts] = OrderedDict()
        self._checking: dict[str, Future] = {}
        self._holds: dict[str, _Hold] = {}

    # ---- checked contents
    def remember(self, sha256: str, facts: ContentFacts) -> None:
        with self._lock:
            self._checked[sha256] = facts
            self._checked.move_to_end(sha256)
            while len(self._checked) > MAX_REMEMBERED:
                self._checked.popitem(last=False)

    def facts(self, sha256: str) -> ContentFacts | None:
        """The facts of a content known to have passed its checks, or None."""
        with self._lock:
            return self._checked.get(sha256)

    def checked(self, sha256: str, check: Callable[[], ContentFacts]) -> ContentFacts:
        """The facts of a content that passed its checks, running `check` unless this content passed
        before or is being checked now (then its outcome is waited for). A refusal raised by `check` is
        raised to every registration of that content waiting on it."""
        with self._lock:
            facts = self._checked.get(sha256)
            if facts is not None:
                self._checked.move_to_end(sha256)
                return facts
            pending = self._checking.get(sha256)
            if pending is None:
                pending = self._checking[sha256] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return pending.result()
        try:
            facts = check()
        except BaseException as e:
            pending.set_exception(e)
            raise
        else:
            self.remember(sha256, facts)
            pending.set_result(facts)
            return facts
        finally:
            with self._lock:
                del self._checking[sha256]

    # ---- blobs and holds
    def hold(self, sha256: str, config_json: bytes, model_safetensors: bytes | None) -> bool:
        """Keep the blob of this content until release(), writing it from these bytes (whose sha256 the
        caller computed) unless it is stored already; True when this call wrote it. A caller that only
        hashed the content (model_safetensors None) gets BlobGone, and no hold, if the blob is missing."""
        with self._lock:
            hold = self._holds.get(sha256)
            if hold is None:
                hold = self._holds[sha256] = _Hold()
            hold.count += 1
        try:
            with hold.write_lock:  # one writer per content; the others find it stored
                if self.blobs.exists(sha256):
                    return False
                if model_safetensors is None:
                    raise BlobGone(sha256)
                self.blobs.put(config_json, model_safetensors, sha256=sha256)
                return True
        except BaseException:
            self.release(sha256)
            raise

    def release(self, sha256: str) -> None:
        with self._lock:
            hold = self._holds[sha256]
            hold.count -= 1
            if hold.count == 0:
                del self._holds[sha256]

    def delete_blob(self, sha256: str) -> bool:
        """Delete a blob unless a registration holds it or a registry entry points at it; True if deleted.
        Both are checked under the lock a registration takes to hold a blob, so none slips in between."""
        with self._lock:
            if sha256 in self._holds or self.references(sha256) > 0:
                return False
            self.blobs.delete(sha256)
            return True
