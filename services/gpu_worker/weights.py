"""Base-model weights: from an HF safetensors checkpoint (single file or sharded) or random (dummy)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.log import get_logger
from shared.model_config import ModelConfig

log = get_logger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_dim + 2*kv_dim, hidden]: q, k, v fused into one GEMM
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, q_dim]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2*intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir}: only safetensors checkpoints are loaded (pickle .bin/.pt files are refused)")
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    files = _checkpoint_files(model_dir)
    for i, path in enumerate(files):
        log.info("model.load_shard", shard=path.name, index=i + 1, total=len(files))
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise KeyError(f"checkpoint {model_dir} lacks tensor {key!r}")
        return tensors.pop(key).to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=torch.cat([take(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]),
            qkv_bias=bias,
            o=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down=take(p + "mlp.down_proj.weight"),
        ))
        if (i + 1) % max(1, cfg.num_layers // 8) == 0:
            log.info("model.load_layers", done=i + 1, total=cfg.num_layers)
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in tensors else take("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    """Real shapes, random values, made on the device directly (no host copy of a multi-GB model)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.02

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * std

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, qkv_out = cfg.hidden_size, cfg.q_dim + 2 * cfg.kv_dim
    layers = []
    for i in range(cfg.num_layers):
        layers.append(LayerWeights(
            input_norm=ones(h), qkv=rand(qkv_out, h), qkv_bias=rand(qkv_out) if cfg.qkv_bias else None,
            o=rand(h, cfg.q_dim), post_norm=ones(h), gate_up=rand(2 * cfg.intermediate_size, h),
            down=rand(h, cfg.intermediate_size)))
        if (i + 1) % max(1, cfg.num_layers // 8) == 0:
            log.info("model.dummy_layers", done=i + 1, total=cfg.num_layers)
    embed = rand(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)
