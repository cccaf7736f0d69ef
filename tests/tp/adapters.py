"""Adapters for the TP tests: PEFT adapters with random nonzero A and B (PEFT starts B at zero, which would
prove nothing), loaded through the same strict loader the server uses; and quick random in-memory ones."""
from __future__ import annotations

from pathlib import Path

import torch

from shared.adapter_format import load_adapter
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import ModelConfig

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Ranks 1, 5, 8, 16, 64: odd ranks and ranks not divisible by 2 or 4; column-only, row-only and mixed
# target sets; per-layer and per-module ranks with rsLoRA scaling. Scales stay near 1: with random A and B
# at std 0.3, a scale of 4 makes attention so peaked that fp32 rounding differences between any two correct
# summation orders (TP or not) pass 1e-4 on some CPUs.
PEFT_ADAPTERS = {
    "r1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
    "r5": dict(r=5, lora_alpha=2, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
               rank_pattern={"model.layers.0.self_attn.q_proj": 3, "down_proj": 7}, use_rslora=True),
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16": dict(r=16, lora_alpha=8, target_modules=ALL),
    "r64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32),
                           LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(std=0.3)
    model.save_pretrained(out_dir)
    return out_dir


def peft_adapters(base_dir: Path, root: Path, cfg: ModelConfig) -> dict[str, LoraWeights]:
    out = {}
    for i, (name, kw) in enumerate(PEFT_ADAPTERS.items()):
        folder = make_peft_adapter(base_dir, root / name, seed=100 + i, **kw)
        out[name] = load_adapter(folder, cfg, max_rank=64, name=name)
    return out


def random_adapter(cfg: ModelConfig, name: str, rank: int, modules: list[str], seed: int = 0) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for m in modules:
        fan_in, fan_out = cfg.module_dims(m)
        layers[m] = [LoraModuleWeights(torch.randn(rank, fan_in, generator=g) * 0.3,
                                       torch.randn(fan_out, rank, generator=g) * 0.3, 2.0 / rank)
                     for _ in range(cfg.num_layers)]
    return LoraWeights(name, cfg.num_layers, layers)
