"""Content-addressed adapter blobs: one file per distinct adapter content, named by its sha256.

A blob is the canonical pair of the adapter's two files in one file:
    MAGIC | u64 little-endian length of the config | canonical adapter_config.json | adapter_model.safetensors
so sha256(blob file) is the adapter's identity and anyone can re-check a blob by hashing it. The identity
is computed while the adapter's files are read (pair_hasher), so a blob is written without hashing again.
Writes are atomic (temp file, fsync, rename, fsync of the folder): after a crash a blob is either
absent or whole, never torn.
"""
from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

MAGIC = b"LPXADPT1"
_HEADER = struct.Struct("<8sQ")
_SHA_LEN = 64
_TMP_SUFFIX = ".tmp"


def pack_pair(config_json: bytes, model_safetensors: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(config_json)) + config_json + model_safetensors


def unpack_pair(blob: bytes) -> tuple[bytes, bytes]:
    if len(blob) < _HEADER.size:
        raise ValueError("blob is shorter than its header")
    magic, n = _HEADER.unpack_from(blob)
    if magic != MAGIC or _HEADER.size + n > len(blob):
        raise ValueError("blob header is corrupt")
    start = _HEADER.size
    return blob[start:start + n], blob[start + n:]


def pair_hasher(config_json: bytes):
    """A sha256 that has taken in the blob's header and config; feed it the safetensors bytes to get the
    pair's identity (so a file can be hashed chunk by chunk as it is read)."""
    h = hashlib.sha256()
    h.update(_HEADER.pack(MAGIC, len(config_json)))
    h.update(config_json)
    return h


def content_sha256(config_json: bytes, model_safetensors: bytes) -> str:
    h = pair_hasher(config_json)
    h.update(model_safetensors)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    def __init__(self, data_dir: str | os.PathLike):
        self.root = Path(data_dir) / "blobs"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != _SHA_LEN or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def put(self, config_json: bytes, model_safetensors: bytes, sha256: str | None = None) -> str:
        """Store a pair and return its sha256; storing the same content again is a no-op. A caller that
        hashed the pair's own bytes while reading them passes that sha256 instead of hashing them again."""
        sha = sha256 or content_sha256(config_json, model_safetensors)
        final = self.path(sha)
        if final.is_file():
            return sha
        # Registrations run on several threads: each write has its own temp file.
        tmp = self.root / f"{sha}.{os.getpid()}-{threading.get_ident()}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, len(config_json)))
                f.write(config_json)
                f.write(model_safetensors)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)
        return sha

    def read(self, sha256: str) -> tuple[bytes, bytes]:
        return unpack_pair(self.path(sha256).read_bytes())

    def read_view(self, sha256: str, buffer=None) -> tuple[bytes, memoryview]:
        """The pair with the safetensors part as a view of one writable buffer the file was read into (no
        copy beyond the read: tensors can view it in place). `buffer(nbytes)`, when given, supplies that
        buffer (a memoryview of exactly nbytes), e.g. one reused by a load thread (read_buffers.py)."""
        with open(self.path(sha256), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view = memoryview(bytearray(size)) if buffer is None else buffer(size)
            n = 0
            while n < size:
                got = f.readinto(view[n:])
                if not got:
                    raise ValueError(f"blob {sha256} shrank while it was read")
                n += got
        config_json, model_safetensors = unpack_pair(view)
        return bytes(config_json), model_safetensors

    def verify(self, sha256: str) -> bool:
        h = hashlib.sha256()
        with open(self.path(sha256), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() == sha256

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)
        _fsync_dir(self.root)

    def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if len(p.name) == _SHA_LEN and not p.name.endswith(_TMP_SUFFIX))

    def remove_temp_files(self) -> int:
        """Temp files left by a crash mid-write; safe to drop at startup, before any write begins."""
        stale = [p for p in self.root.iterdir() if p.name.endswith(_TMP_SUFFIX)]
        for p in stale:
            p.unlink(missing_ok=True)
        return len(stale)
