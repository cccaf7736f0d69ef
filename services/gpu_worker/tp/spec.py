"""What rank 0 tells a follower process at launch, as JSON on its command line (plain data, no pickle)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.model_config import ModelConfig


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a group whose rank 0 uses `device`: the same CPU, or the r-th GPU after rank 0's."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank)
    raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device!r}")


def model_config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    return ModelConfig(**d)


@dataclass
class FollowerSpec:
    rank: int
    size: int
    parent_pid: int
    channel: str  # ZeroMQ address of rank 0's control socket
    store_host: str
    store_port: int  # rank 0's torch.distributed TCPStore
    model: dict  # ModelConfig fields
    weights: dict  # {"model_dir": path} or {"dummy_seed": n}
    engine: dict  # EngineConfig fields
    backend: str = "auto"
    start_timeout_s: float = 300.0
    collective_timeout_s: float = 300.0
    log_level: str = "info"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FollowerSpec":
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown follower spec field(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def model_config(self) -> ModelConfig:
        return model_config_from_dict(self.model)

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.engine)
