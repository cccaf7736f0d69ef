"""Packing an adapter into the pool's row format: every value lands where the kernels read it, rounded to
the pool's dtype once, whatever dtype the adapter came in."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.adapter_layout import chunks, pack_adapter
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import MODULES, ModelConfig

CFG = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64})


def _adapter(source_dtype: torch.dtype, scale: float) -> LoraWeights:
    g = torch.Generator().manual_seed(3)
    modules = {}
    for mi, m in enumerate(MODULES):
        if m == "up_proj":
            continue  # one module not adapted at all
        fan_in, fan_out = CFG.module_dims(m)
        layers = []
        for layer in range(CFG.num_layers):
            if (layer + mi) % 4 == 3:
                layers.append(None)  # a layer this module skips
                continue
            r = 4 if layer != 1 else 2  # rank_pattern: a lower rank in one layer leaves zero rows
            a = torch.randn(r, fan_in, generator=g, dtype=torch.float64).to(source_dtype)
            b = torch.randn(fan_out, r, generator=g, dtype=torch.float64).to(source_dtype)
            layers.append(LoraModuleWeights(a, b, scale))
        modules[m] = layers
    return LoraWeights("x", CFG.num_layers, modules)


def _expected_rows(weights: LoraWeights, slot_width: int, dtype: torch.dtype):
    """The layout spelled out from its definition: A rows and scaled Bᵀ rows, padded, in fp32, cast once."""
    packed = pack_adapter(weights, CFG, slot_width, dtype)
    expected = torch.zeros(packed.rows.shape, dtype=torch.float32)
    for mi, m in enumerate(MODULES):
        r = packed.ranks[mi]
        if r == 0:
            continue
        fan_in, fan_out = CFG.module_dims(m)
        ci, co = chunks(fan_in, slot_width), chunks(fan_out, slot_width)
        for layer, w in enumerate(weights.modules[m]):
            if w is None:
                continue
            a = torch.zeros(r, ci * slot_width)
            a[:w.rank, :fan_in] = w.lora_a.float()
            bt = torch.zeros(r, co * slot_width)
            bt[:w.rank, :fan_out] = (w.lora_b.float() * w.scale).t()
            expected[layer, 0, packed.a_off[mi]: packed.a_off[mi] + r * ci] = a.view(r * ci, slot_width)
            expected[layer, 1, packed.b_off[mi]: packed.b_off[mi] + r * co] = bt.view(r * co, slot_width)
    return packed, expected.to(dtype)


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_packed_rows_are_the_padded_a_and_scaled_bt_rounded_once(source_dtype, dtype, scale):
    packed, expected = _expected_rows(_adapter(source_dtype, scale), CFG.kv_dim, dtype)
    assert packed.rows.dtype == dtype
    assert packed.ranks[MODULES.index("up_proj")] == 0 and packed.max_rank == 4
    assert torch.equal(packed.rows, expected)
    assert packed.rows.abs().sum() > 0
