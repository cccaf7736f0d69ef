"""Each stored content's rows in the arena's layout, kept on disk beside its blob.

A load from disk otherwise reads the blob, checks it against the model and packs it (every Bᵀ transposed
and scaled): for a 176 MB S-GQA adapter ~35 ms of reading and ~60 ms of packing on one core. From its
packed file it is one read straight into the adapter's arena range. The file is a cache derived from the
blob: written when a content is registered (or, for one stored before, at its first load), deleted with
the blob, and ignored (then written again) when it does not read back whole. The folder is named by
everything the rows depend on besides the content (the model and checks' fingerprint, row dtype, slot
width, the layout's code): files of any other are dropped, and all of them when packed rows are off.

Layout: MAGIC | u32 little-endian length of a JSON header | header {shape, ranks, a_off, b_off} | rows.
The file's size must be exactly that. Files are not fsync'd (a cache): one torn by a crash reads back
short and is written again. None is written while it would leave less than `min_free_bytes` free on the
disk, which registrations need for blobs (a load without a file only costs a repack).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import threading
from pathlib import Path

import structlog
import torch

from services.gpu_worker import adapter_layout
from services.gpu_worker.adapter_layout import PackedAdapter
from shared.model_config import MODULES

log = structlog.get_logger("adapter_store")

MAGIC = b"LPXROWS1"
_PREFIX = struct.Struct("<8sI")
_HEADER_LIMIT = 1 << 20
_TMP_SUFFIX = ".tmp"
_SHA_LEN = 64


def drop_all(data_dir: str | os.PathLike) -> None:
    """Packed rows turned off: their disk space comes back."""
    shutil.rmtree(Path(data_dir) / "packed", ignore_errors=True)


class PackedRows:
    def __init__(self, data_dir: str | os.PathLike, dtype: torch.dtype, slot_width: int, fingerprint: str,
                 min_free_bytes: int = 0):
        self.dtype = dtype
        self.slot_width = slot_width
        self.min_free_bytes = min_free_bytes
        self.skipped_for_space = 0  # files not written to keep min_free_bytes free
        key = hashlib.sha256(f"{fingerprint}|{dtype}|{slot_width}|".encode()
                             + Path(adapter_layout.__file__).read_bytes()).hexdigest()[:16]
        self.root = Path(data_dir) / "packed" / key
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != _SHA_LEN or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256

    def read(self, sha256: str, name: str, out: torch.Tensor | None = None) -> tuple[PackedAdapter, bool] | None:
        """The content's rows, read into `out` (a byte tensor, e.g. an arena range) when they are exactly its
        size (True), else into memory of their own (False); None when there is no whole file for it."""
        path = self.path(sha256)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(_PREFIX.size)
                magic, n = _PREFIX.unpack(prefix) if len(prefix) == _PREFIX.size else (b"", 0)
                if magic != MAGIC or n > _HEADER_LIMIT:
                    return self._unreadable(path, "not a packed rows file")
                header = json.loads(f.read(n))
                shape = tuple(int(d) for d in header["shape"])
                if len(shape) != 4 or shape[3] != self.slot_width or min(shape) < 1 or any(
                        len(header[k]) != len(MODULES) for k in ("ranks", "a_off", "b_off")):
                    return self._unreadable(path, f"rows {shape} do not fit this store's layout")
                nbytes = math.prod(shape) * self.dtype.itemsize
                if size != _PREFIX.size + n + nbytes:
                    return self._unreadable(path, f"{size} bytes, the header says {_PREFIX.size + n + nbytes}")
                in_place = out is not None and out.numel() == nbytes
                dest = out if in_place else torch.empty(nbytes, dtype=torch.uint8)
                _read_exactly(f, dest, nbytes)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
            return self._unreadable(path, str(e))
        rows = dest.view(self.dtype).view(shape)
        return PackedAdapter(name, rows, tuple(header["ranks"]), tuple(header["a_off"]), tuple(header["b_off"])), in_place

    def write(self, sha256: str, packed: PackedAdapter) -> None:
        """Keep `packed` as the content's rows (atomically: a reader sees the whole file or none)."""
        final = self.path(sha256)
        if final.is_file():
            return
        nbytes = packed.rows.numel() * packed.rows.element_size()
        stat = os.statvfs(self.root)
        if stat.f_bavail * stat.f_frsize - nbytes < self.min_free_bytes:
            if self.skipped_for_space == 0:
                log.warning("packed_rows_disk_reserve", free_bytes=stat.f_bavail * stat.f_frsize,
                            reserve_bytes=self.min_free_bytes)
            self.skipped_for_space += 1
            return
        header = json.dumps({"shape": list(packed.rows.shape), "ranks": list(packed.ranks),
                             "a_off": list(packed.a_off), "b_off": list(packed.b_off)}).encode()
        # Several load threads may write the same content (names sharing it): each has its own temp file.
        tmp = self.root / f"{sha256}.{os.getpid()}-{threading.get_ident()}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                for part in (_PREFIX.pack(MAGIC, len(header)) + header,
                             packed.rows.contiguous().view(torch.uint8).reshape(-1).numpy()):
                    view = memoryview(part)
                    while view:  # an unbuffered write may take part of it
                        view = view[f.write(view):]
            os.replace(tmp, final)
        except OSError as e:  # a full disk costs the next load a repack, never the load itself
            tmp.unlink(missing_ok=True)
            log.warning("packed_rows_unwritten", sha256=sha256, error=str(e))

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def keep_only(self, referenced: set[str]) -> int:
        """At startup: drop temp files, the files of contents no longer stored and every other layout's
        folder; how many files and folders were dropped."""
        others = [p for p in self.root.parent.iterdir() if p != self.root]
        for p in others:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        stale = [p for p in self.root.iterdir() if p.name.endswith(_TMP_SUFFIX) or p.name not in referenced]
        for p in stale:
            p.unlink(missing_ok=True)
        return len(others) + len(stale)

    def _unreadable(self, path: Path, why: str) -> None:
        log.warning("packed_rows_unreadable", file=path.name, reason=why)
        path.unlink(missing_ok=True)
        return None


def _read_exactly(f, dest: torch.Tensor, nbytes: int) -> None:
    view = memoryview(dest.numpy())
    got = 0
    while got < nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise ValueError("packed rows file shrank while it was read")
        got += n
