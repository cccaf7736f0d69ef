"""Typed configuration of `loraplex up`; field docs become `--help`, unknown keys are rejected."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from shared.config import add_config_arguments, from_dict
from shared.config import doc_field as _doc

SERVICES = ("redis", "adapter_store", "scheduler", "gpu_worker", "gateway")




@dataclass
class LauncherConfig:
    """Start loraplex in the foreground: Redis (embedded unless --redis-url), the adapter store, the scheduler,
    the GPU worker(s) and the gateway. Ctrl-C or SIGTERM drains and stops them all. With no model given, a tiny
    random model and a few demo adapters are created in the data dir and served."""

    model: str = _doc("base model folder (HF Llama/Mistral/Qwen2 safetensors checkpoint with tokenizer)", "")
    dummy_weights: str = _doc("config.json (or its folder) for random weights of real shapes, for benchmarks", "")
    device: str = _doc("cuda or cpu; empty = cuda when a GPU is visible, else cpu", "")
    host: str = _doc("address the HTTP API listens on", "127.0.0.1")
    port: int = _doc("HTTP port", 8000)
    data_dir: str = _doc("folder for Redis's AOF, adapter blobs, the demo model and runtime files", "./data")
    redis_url: str = _doc("use this Redis instead of starting one (it must have AOF with appendfsync always)", "")
    workers: int = _doc("GPU worker processes (data parallel; one GPU each on CUDA)", 1)
    tp: int = _doc("tensor-parallel degree of each worker (GPUs per worker)", 1)
    dtype: str = _doc("compute dtype; empty = bfloat16 on CUDA, float32 on CPU", "")
    num_slots: int = _doc("slots in each worker's unified pool; 0 = size from GPU memory (CUDA), 4096 on CPU", 0)
    arena_bytes: int = _doc("size of the shared-memory host adapter cache in bytes", 256 * 2**20)
    allowed_root: str = _doc("server folder adapters may be registered from by path; empty = path registration off", "")
    api_keys_file: str = _doc('JSON file {"admin_keys": [...], "tenants": {...}} enabling auth; empty = no auth', "")
    drain_timeout_s: float = _doc("on Ctrl-C/SIGTERM, time in-flight requests get to finish", 30.0)
    ready_timeout_s: float = _doc("time each service gets to report ready at startup", 300.0)
    heartbeat_timeout_s: float = _doc("a worker silent this long is dead: the scheduler requeues or fails its requests "
                                      "and the launcher kills and restarts it (CPU steps can take seconds)", 10.0)
    demo_adapters: int = _doc("demo adapters created and registered with the embedded default model", 4)
    log_json: bool = _doc("services log one JSON object per line", False)
    set: list = _doc("extra flag for one service, SERVICE.FLAG=VALUE (repeatable), e.g. scheduler.max_queue=64", None)

    def __post_init__(self) -> None:
        if self.set is None:
            self.set = []
        if self.model and self.dummy_weights:
            raise ValueError("give at most one of --model and --dummy-weights")
        if self.workers < 1 or self.tp < 1:
            raise ValueError("--workers and --tp must be at least 1")
        if self.device and self.device.split(":")[0] not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu, got {self.device!r}")
        if self.heartbeat_timeout_s <= 0 or self.drain_timeout_s < 0 or self.ready_timeout_s <= 0:
            raise ValueError("--heartbeat-timeout-s and --ready-timeout-s must be positive, --drain-timeout-s >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for item in self.set:
            service_extra(item)

    @property
    def embedded_default(self) -> bool:
        return not self.model and not self.dummy_weights

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).resolve()

    @classmethod
    def from_dict(cls, values: dict) -> "LauncherConfig":
        return from_dict(cls, values)


def service_extra(item: str) -> tuple[str, str, str]:
    """`scheduler.max_queue=4` -> ("scheduler", "--max-queue", "4"); names the problem when malformed."""
    key, eq, value = item.partition("=")
    service, dot, flag = key.partition(".")
    aliases = {"store": "adapter_store", "worker": "gpu_worker"}
    service = aliases.get(service, service)
    if not eq or not dot or not flag or service not in SERVICES or service == "redis":
        raise ValueError(f"--set {item!r}: expected SERVICE.FLAG=VALUE with SERVICE one of "
                         f"adapter_store, scheduler, gpu_worker, gateway")
    return service, "--" + flag.replace("_", "-"), value


def parse_args(argv: list[str] | None = None) -> LauncherConfig:
    parser = argparse.ArgumentParser(prog="loraplex up", description=LauncherConfig.__doc__)
    add_config_arguments(parser, LauncherConfig, skip=("set",))
    set_field = next(f for f in fields(LauncherConfig) if f.name == "set")
    parser.add_argument("--set", dest="set", action="append", default=[], metavar="SERVICE.FLAG=VALUE",
                        help=set_field.metadata["doc"])
    try:
        return LauncherConfig(**vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
