"""Tiny pools with real packed adapters, shared by the kernel tests.

Shapes are chosen to reach both row-addressing paths of the LoRA kernels: a slot width of 16 (tiles
never straddle a slot) and one of 20 (rows straddle slots inside a tile), with odd lengths throughout.
"""
from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from services.gpu_worker.adapter_layout import pack_adapter
from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
from services.gpu_worker.ops.meta import LoraTables
from services.gpu_worker.pool import UnifiedPool
from shared.kernel_shapes import LaunchShapes
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import MODULES, ModelConfig

# Slot width 16 (2 KV heads x 8): aligned tiles. Hidden 48, intermediate 72 (not a tile multiple).
ALIGNED_CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=48, intermediate_size=72, num_layers=1,
                          num_heads=4, num_kv_heads=2, head_dim=8)
# Slot width 20 (2 KV heads x 10): rows straddle slots inside a tile; hidden 40, intermediate 56.
STRADDLE_CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=40, intermediate_size=56, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=10)

# Mixed ranks 1, 7, 64 and rank 0 (module not adapted); the rank-64 adapter spans many slots.
ADAPTER_RANKS = [
    {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1, "gate_proj": 1, "up_proj": 1, "down_proj": 1},
    {"q_proj": 7, "v_proj": 7, "gate_proj": 7, "down_proj": 7},
    {"q_proj": 64, "k_proj": 64, "v_proj": 64, "o_proj": 64, "up_proj": 64, "gate_proj": 64},
    {"k_proj": 3, "up_proj": 5},
]


def random_adapter(name: str, cfg: ModelConfig, ranks: dict[str, int], gen: torch.Generator) -> LoraWeights:
    modules = {}
    for m, r in ranks.items():
        fan_in, fan_out = cfg.module_dims(m)
        a = torch.randn(r, fan_in, generator=gen) / fan_in ** 0.5
        b = torch.randn(fan_out, r, generator=gen)
        modules[m] = [LoraModuleWeights(a, b, scale=0.5)]
    return LoraWeights(name, cfg.num_layers, modules)


class LoraPool:
    """A one-layer unified pool holding packed adapters at scattered slots, and its resident tables."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, seed: int, extra_resident: int = 1):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.cfg = cfg
        width = cfg.kv_dim
        packed = [pack_adapter(random_adapter(f"a{i}", cfg, r, gen), cfg, width, dtype)
                  for i, r in enumerate(ADAPTER_RANKS)]
        need = sum(p.n_slots for p in packed)
        self.pool = UnifiedPool(1, need + 64, width, dtype, "cpu")
        # Free every slot in a shuffled order, so adapters land on scattered, non-monotonic slot ids.
        all_slots = self.pool.allocator.allocate(self.pool.num_slots)
        rng.shuffle(all_slots)
        self.pool.allocator.free(all_slots)
        self.pool.kv.normal_(generator=gen)  # rows nobody owns hold garbage, not zeros
        resident = len(packed) + extra_resident  # a resident row nobody uses: ids need not be dense
        max_slots = max(p.n_slots for p in packed)
        slots = torch.zeros(resident, max_slots, dtype=torch.int32)
        ranks = torch.zeros(resident, len(MODULES), dtype=torch.int32)
        a_off = torch.zeros_like(ranks)
        b_off = torch.zeros_like(ranks)
        for i, p in enumerate(packed):
            ids = self.pool.allocator.allocate(p.n_slots)
            self.pool.write_adapter_rows(torch.tensor(ids), p.rows)
            slots[i, : p.n_slots] = torch.tensor(ids, dtype=torch.int32)
            ranks[i] = torch.tensor(p.ranks, dtype=torch.int32)
            a_off[i] = torch.tensor(p.a_off, dtype=torch.int32)
            b_off[i] = torch.tensor(p.b_off, dtype=torch.int32)
        self.tables = LoraTables(slots, ranks, a_off, b_off)
        self.num_adapters = len(packed)
        self.k_buf = self.pool.k(0)
        self.v_buf = self.pool.v(0)

    def max_rank(self, token_adapter: torch.Tensor, modules: tuple[int, ...]) -> int:
        used = [a for a in token_adapter.tolist() if a >= 0]
        return max([int(self.tables.ranks[a, m]) for a in used for m in modules], default=0)


@pytest.fixture(params=[ALIGNED_CFG, STRADDLE_CFG], ids=["aligned", "straddle"])
def model_cfg(request) -> ModelConfig:
    return request.param


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative error in norm within the dtype's budget, no NaN (poisoned outputs must be overwritten), and
    exact zeros wherever the reference is exactly zero (base-only tokens, rows past an adapter's rank)."""
    assert not torch.isnan(out).any(), "output has NaN: some elements were not written"
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} exceeds {tol:.0e}"
    zero = ref == 0
    assert torch.equal(out[zero], ref[zero]), "kernel wrote non-zero values where the reference is zero"


@contextmanager
def launch_shapes_set(text: str):
    """The worker's kernel_shapes set to `text` for the block, the defaults again after."""
    set_launch_shapes(LaunchShapes.parse(text))
    try:
        yield
    finally:
        set_launch_shapes(LaunchShapes())
