"""Typed configuration of the adapter_store service; field docs become `--help`."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import config_from_args, from_dict
from shared.config import doc_field as _doc


@dataclass
class StoreConfig:
    """Settings of the adapter_store process."""

    bind: str = _doc("ZeroMQ address the store's ROUTER socket binds", "tcp://127.0.0.1:5560")
    data_dir: str = _doc("directory for adapter blobs (data_dir/blobs)", "./loraplex-data")
    redis_url: str = _doc("Redis holding the registry (needs AOF with appendfsync always)", "redis://127.0.0.1:6379/0")
    key_prefix: str = _doc("prefix of every Redis key the registry writes", "loraplex")
    model_dir: str = _doc("base model folder (config.json) adapters are checked against", "")
    dtype: str = _doc("dtype of adapter rows in the arena: the engine's float32, float16 or bfloat16", "float32")
    max_rank: int = _doc("largest adapter rank accepted", 256)
    max_upload_bytes: int = _doc("largest adapter (config + safetensors) accepted, in bytes; larger -> 413", 512 * 2**20)
    allowed_root: str = _doc("server folder that path registrations must lie under; empty = path registration off", "")
    arena_bytes: int = _doc("size of the shared-memory adapter arena in bytes (from config, never from the machine)", 256 * 2**20)
    arena_name: str = _doc("name of the arena's shared-memory segment; empty = derived from the process id", "")
    registration_threads: int = _doc("registrations read, hashed, checked and stored at once, each on its own thread "
                                     "(lookups, acquires and releases are answered meanwhile)", 8)
    load_threads: int = _doc("adapters read from disk into the arena at once for workers' acquires, on threads of "
                             "their own so that a burst of registrations never delays a worker; each keeps a read buffer as "
                             "large as the largest blob it has read", 4)
    packed_rows: bool = _doc("keep each stored content's rows in the arena's layout on disk as well (as many bytes "
                             "again as the blobs), so that a load from disk is one read, without checks or "
                             "repacking", True)
    packed_rows_min_free_gb: float = _doc("packed rows are not written while they would leave less than this "
                                          "much disk free (GB), which registrations need for blobs", 4.0)
    require_durable_redis: bool = _doc("refuse to start unless Redis has AOF on with appendfsync always", True)

    @classmethod
    def from_dict(cls, values: dict) -> "StoreConfig":
        return from_dict(cls, values)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "StoreConfig":
        return config_from_args(cls, argv, "python -m services.adapter_store")
