"""Typed configuration. Field docs double as CLI help; unknown keys are rejected."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields


def _doc(text: str, default):
    return field(default=default, metadata={"doc": text})


@dataclass
class EngineConfig:
    """Settings of one engine (one GPU worker or TP group)."""

    device: str = _doc("torch device: cpu or cuda[:N]", "cpu")
    dtype: str = _doc("compute dtype: float32, float16 or bfloat16", "float32")
    num_slots: int = _doc("slots in the unified pool (KV tokens and adapter rows share them); 0 = size from pool_memory_fraction", 4096)
    pool_memory_fraction: float = _doc("fraction of free GPU memory for the pool when num_slots is 0", 0.85)
    max_lora_rank: int = _doc("largest adapter rank accepted", 256)
    max_resident_adapters: int = _doc("adapters kept in the pool at once (resident table rows)", 128)
    max_running_requests: int = _doc("requests in the running batch at most", 256)
    max_batched_tokens: int = _doc("tokens per step at most (prefill chunks + decodes)", 2048)
    max_model_len: int = _doc("prompt + output tokens at most; 0 = model's max_position_embeddings", 0)
    seed: int = _doc("seed for dummy weights", 0)
    cuda_graphs: bool = _doc("replay decode steps from CUDA graphs (CUDA only)", True)
    cuda_graph_max_batch: int = _doc("largest decode batch replayed from a graph; bigger ones run eagerly", 256)

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        return from_dict(cls, values)


def from_dict(cls, values: dict):
    """Build a config dataclass, naming any unknown key instead of silently ignoring it."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def field_docs(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}
