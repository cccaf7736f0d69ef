"""Checks on everything a client hands the store, before a byte of it is stored.

Names and tenants follow one pattern (lowercase, no path separators, cannot start with a dot). Uploads are
capped in bytes. Server-side paths must resolve, symlinks included, to a folder under the allow-listed
root, and so must the two files read from it. Content is parsed by shared/adapter_format.py (safetensors
only, never pickle) against the base model's geometry.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shared.lora_weights import LoraWeights
from shared.model_config import MODULES, ModelConfig

from .errors import StoreRefusal, bad_request

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
CONFIG_FILE = "adapter_config.json"
MODEL_FILE = "adapter_model.safetensors"
# Formats that unpickle on load: refused by name so the client learns why, not just "bad safetensors".
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")


def check_name(name: object, param: str = "name") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise bad_request("invalid_name", f"{param} must match {NAME_PATTERN.pattern} (got {str(name)[:80]!r})", param)
    return name


def check_tenant(tenant: object) -> str:
    """"" is the shared namespace; any other tenant follows the name pattern."""
    if tenant == "":
        return ""
    return check_name(tenant, "tenant")


def check_upload_size(config_json: bytes, model_safetensors: bytes, limit: int) -> None:
    total = len(config_json) + len(model_safetensors)
    if total > limit:
        raise StoreRefusal(413, "adapter_too_large", f"adapter is {total} bytes; the limit is {limit} bytes", "adapter_model")


def looks_like_pickle(data: bytes) -> bool:
    # safetensors: 8-byte header length, then the JSON header, so byte 8 is "{" (its first byte may well be
    # 0x80). A pickle starts with the PROTO opcode 0x80 and a protocol number; torch.save writes a zip.
    if data[8:9] == b"{":
        return False
    return (data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")) or data[:4] == b"PK\x03\x04"


def canonical_config(config_json: bytes) -> bytes:
    """adapter_config.json re-serialized with sorted keys, so formatting alone never changes identity."""
    try:
        parsed = json.loads(config_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request("invalid_adapter_config", f"{CONFIG_FILE} is not valid JSON: {e}", "adapter_config") from None
    if not isinstance(parsed, dict):
        raise bad_request("invalid_adapter_config", f"{CONFIG_FILE} must be a JSON object", "adapter_config")
    try:
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        raise bad_request("invalid_adapter_config", f"{CONFIG_FILE} contains NaN or Infinity", "adapter_config") from None


def _resolved_within(candidate: Path, root: Path, missing: StoreRefusal, outside: str) -> Path:
    """`candidate` with every link followed, refused with `missing` when it does not exist and with `outside`
    (an invalid_path message) when it leads out of `root`."""
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise missing from None
    if not real.is_relative_to(root):
        raise bad_request("invalid_path", outside, "path")
    return real


def resolve_under_root(path: str, allowed_root: str) -> Path:
    """The real folder a client-given path names, refused unless it lies under the allowed root."""
    if not allowed_root:
        raise StoreRefusal(400, "path_registration_disabled", "registering from a server path is not enabled", "path")
    if not isinstance(path, str) or not path or "\x00" in path:
        raise bad_request("invalid_path", "path must be a non-empty string", "path")
    if ".." in Path(path).parts:
        raise bad_request("invalid_path", "path must not contain '..'", "path")
    root = Path(allowed_root).resolve(strict=True)
    candidate = Path(path) if Path(path).is_absolute() else root / path
    missing = bad_request("invalid_path", f"path {path!r} does not exist under the allowed root", "path")
    real = _resolved_within(candidate, root, missing, f"path {path!r} is outside the allowed root")
    if not real.is_dir():
        raise bad_request("invalid_path", f"path {path!r} is not a folder", "path")
    return real


READ_CHUNK = 1 << 20  # hashed while still in cache from the read


def read_adapter_dir(folder: Path, root: str, limit: int,
                     start_hash: Callable[[bytes], Any] | None = None, keep: bool = True) -> tuple[bytes, Any, Any]:
    """The two adapter files of a folder under the root, each checked for escapes and size before reading.

    The model file is read in chunks into one buffer; `start_hash(config bytes)` may return a hash object,
    which is fed each chunk as it arrives (the content is hashed in the same pass as it is read). Returns
    (config bytes, model bytes, that hash object or None). With keep=False the model file is only hashed,
    through one chunk-sized buffer, and its size in bytes stands in for its bytes: a registration of
    content the store holds already (hard-linked copies under many names) needs its hash, not a copy."""
    real_root = Path(root).resolve(strict=True)
    if not (folder / MODEL_FILE).exists():
        pickled = [p for p in PICKLE_FILES if (folder / p).exists()]
        if pickled:
            raise bad_request("pickle_refused", f"{pickled[0]} is a pickle format and is never loaded; provide {MODEL_FILE}", "path")
    config_json = _read_under_root(folder, CONFIG_FILE, real_root, limit, limit, None)
    hasher = start_hash(bytes(config_json)) if start_hash is not None else None
    budget = limit - len(config_json)
    if keep:
        model = _read_under_root(folder, MODEL_FILE, real_root, budget, limit, hasher)
    else:
        model = _hash_under_root(folder, MODEL_FILE, real_root, budget, limit, hasher)
    return bytes(config_json), model, hasher


def _open_under_root(folder: Path, fname: str, real_root: Path, budget: int, limit: int):
    """The file, opened read-only once it is known to lie under the root and be a regular file no larger
    than the budget; and the refusal to raise should it turn out larger while read."""
    real = _resolved_within(folder / fname, real_root,
                            bad_request("invalid_adapter", f"{fname} is missing from the adapter folder", "path"),
                            f"{fname} links outside the allowed root")
    too_large = StoreRefusal(413, "adapter_too_large", f"adapter files exceed the limit of {limit} bytes", "path")
    # O_NOFOLLOW: the file cannot be swapped for a symlink between the check above and the open.
    # O_NONBLOCK: a FIFO put in the file's place is refused below instead of holding a registration thread
    # until someone writes to it (it changes nothing for a regular file).
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    f = os.fdopen(fd, "rb", buffering=0)
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise bad_request("invalid_adapter", f"{fname} is not a regular file", "path")
        if st.st_size > budget:
            raise too_large
    except BaseException:
        f.close()
        raise
    return f, st.st_size, too_large


def _read_under_root(folder: Path, fname: str, real_root: Path, budget: int, limit: int, hasher) -> bytearray:
    f, size, too_large = _open_under_root(folder, fname, real_root, budget, limit)
    with f:
        # One byte over the size seen, to notice a file that grew since it was checked.
        data = bytearray(size + 1)
        view = memoryview(data)
        n = 0
        while n < len(data):
            got = f.readinto(view[n:n + READ_CHUNK])
            if not got:
                break
            if hasher is not None:
                hasher.update(view[n:n + got])
            n += got
        view.release()
        while n == len(data) and n <= budget:  # it grew: read on, at most one byte past the budget
            rest = f.read(min(READ_CHUNK, budget + 1 - n))
            if not rest:
                break
            if hasher is not None:
                hasher.update(rest)
            data += rest
            n += len(rest)
    if n > budget:
        raise too_large
    del data[n:]
    return data


def _hash_under_root(folder: Path, fname: str, real_root: Path, budget: int, limit: int, hasher) -> int:
    """Bytes in the file, each fed to `hasher` through one reused chunk buffer (no copy of the file)."""
    f, _, too_large = _open_under_root(folder, fname, real_root, budget, limit)
    chunk = memoryview(bytearray(READ_CHUNK))
    n = 0
    with f:
        while n <= budget:
            got = f.readinto(chunk)
            if not got:
                break
            if hasher is not None:
                hasher.update(chunk[:got])
            n += got
    if n > budget:
        raise too_large
    return n


@dataclass
class CheckedAdapter:
    """Content that passed every check: the canonical config, the safetensors bytes and what they hold."""

    config_json: bytes
    model_safetensors: bytes
    weights: LoraWeights
    rank: int
    target_modules: list[str]


def check_content(config_json: bytes, model_safetensors: bytes, cfg: ModelConfig, max_rank: int) -> CheckedAdapter:
    from shared.adapter_format import AdapterError, load_adapter_bytes

    if looks_like_pickle(model_safetensors):
        raise bad_request("pickle_refused", "adapter_model is a pickle/torch.save file; only safetensors is accepted", "adapter_model")
    canonical = canonical_config(config_json)
    try:
        weights = load_adapter_bytes(canonical, model_safetensors, cfg, max_rank)
    except AdapterError as e:
        raise bad_request("invalid_adapter", str(e), "adapter_model") from None
    targets = [m for m in MODULES if weights.module_rank(m) > 0]
    if not targets:
        raise bad_request("invalid_adapter", "adapter adapts no module", "adapter_model")
    return CheckedAdapter(canonical, model_safetensors, weights, weights.max_rank, targets)
