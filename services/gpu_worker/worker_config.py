"""Typed configuration of one gpu_worker process; field docs become `--help`, unknown keys are rejected.

The engine's own settings (EngineConfig) are flattened into the same command line, so
`python -m services.gpu_worker --help` lists everything the process can be told.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from shared.config import EngineConfig, add_config_arguments, from_dict
from shared.config import doc_field as _doc




@dataclass
class WorkerConfig:
    """Settings of one gpu_worker process (one GPU, or one tensor-parallel group)."""

    worker_id: str = _doc("name of this worker in WorkerStatus and logs; stable across restarts", "worker-0")
    model: str = _doc("base model folder (HF safetensors checkpoint with config.json)", "")
    dummy_weights: str = _doc("config.json (or a folder holding one) for random weights of real shapes", "")
    scheduler_addr: str = _doc("ZeroMQ address of the scheduler's worker socket", "tcp://127.0.0.1:5561")
    store_addr: str = _doc("ZeroMQ address of the adapter_store", "tcp://127.0.0.1:5560")
    tp: int = _doc("tensor-parallel degree", 1)
    backend: str = _doc("op backend: auto (triton on CUDA, reference on CPU), reference or triton", "auto")
    heartbeat_s: float = _doc("WorkerStatus period while idle (every step sends one while busy)", 0.25)
    acquire_timeout_s: float = _doc("wait at most this long for the adapter_store to hand out an adapter (keep it under "
                                    "the scheduler's heartbeat timeout: the loop sends no status meanwhile)", 5.0)
    adapter_load_timeout_s: float = _doc("give up on an adapter the store has not handed out after this long while it "
                                         "answers other calls (loads from disk queue behind each other)", 120.0)
    ready_file: str = _doc("file written when the worker is ready and touched every heartbeat (supervisor liveness)", "")
    warmup: str = _doc("run throwaway requests before reporting ready so kernels compile first: auto (on CUDA), on, off", "auto")
    gpu_prefetch_free_fraction: float = _doc(
        "load hinted adapters into the GPU pool ahead of use only while at least this fraction of slots is free", 0.5)

    @classmethod
    def from_dict(cls, values: dict) -> "WorkerConfig":
        return from_dict(cls, values)

    def validate(self) -> None:
        if bool(self.model) == bool(self.dummy_weights):
            raise ValueError("give exactly one of --model DIR or --dummy-weights CONFIG")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup must be auto, on or off, got {self.warmup!r}")
        if self.heartbeat_s <= 0 or self.acquire_timeout_s <= 0:
            raise ValueError("heartbeat_s and acquire_timeout_s must be positive")
        if self.adapter_load_timeout_s < self.acquire_timeout_s:
            raise ValueError("adapter_load_timeout_s must be at least acquire_timeout_s")


def _add_fields(parser: argparse.ArgumentParser, cls, title: str) -> None:
    add_config_arguments(parser.add_argument_group(title, cls.__doc__), cls)


def parse_args(argv: list[str] | None = None) -> tuple[WorkerConfig, EngineConfig]:
    parser = argparse.ArgumentParser(prog="python -m services.gpu_worker", description=WorkerConfig.__doc__)
    _add_fields(parser, WorkerConfig, "worker")
    _add_fields(parser, EngineConfig, "engine")
    values = vars(parser.parse_args(argv))
    worker_keys = {f.name for f in fields(WorkerConfig)}
    worker = WorkerConfig(**{k: v for k, v in values.items() if k in worker_keys})
    try:
        engine = EngineConfig(**{k: v for k, v in values.items() if k not in worker_keys})
        worker.validate()
    except ValueError as e:
        parser.error(str(e))
    return worker, engine
