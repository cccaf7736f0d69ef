"""Base-model geometry read from a Hugging Face `config.json` (Llama, Mistral, Qwen2 families)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Canonical order of adaptable linear modules; tables and kernels index modules by this position.
MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_INDEX = {name: i for i, name in enumerate(MODULES)}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Llama-family decoder; only what the engine and adapter checks need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    sliding_window: int | None = None  # Mistral: attention reaches back at most this many tokens

    @property
    def kv_dim(self) -> int:
        """Width of one K (or V) row of the pool: every KV head of one token."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    def group_dims(self, modules: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """(in_features shared by a fused group of MODULES indices, their out_features in order)."""
        dims = [self.module_dims(MODULES[m]) for m in modules]
        return dims[0][0], tuple(d[1] for d in dims)

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of an adaptable linear module."""
        h, i = self.hidden_size, self.intermediate_size
        dims = {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in dims:
            raise KeyError(f"unknown module {module!r}; adaptable modules are {', '.join(MODULES)}")
        return dims[module]

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            # Qwen2 always has q/k/v bias; Llama exposes it as attention_bias.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        with open(path) as f:
            return cls.from_hf(json.load(f))
