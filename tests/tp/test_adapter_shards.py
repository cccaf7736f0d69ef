"""Adapter shares in the pool row format: each weight element on exactly one rank, the same layout on every
rank, and the shares put back together give the adapter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.gpu_worker.adapter_layout import chunks, layout_offsets, pack_adapter
from services.gpu_worker.tp.adapter_shards import module_factors, shard_adapter, shard_offsets
from services.gpu_worker.tp.layout import COLUMN_MODULES, TPLayout
from shared.model_config import MODULES, ModelConfig

from .adapters import ALL, random_adapter

CFG = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=176, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def shard_factors(shard, layout, module):
    """A `[L, rows, len]` and Bᵀ `[L, r, len]` of one module as stored in a rank's share."""
    mi = MODULES.index(module)
    r = shard.ranks[mi]
    a_len, b_len = layout.shard_row_lengths(module)
    w = layout.slot_width
    rows = layout.shrink_rank(module, r)
    ca, cb = chunks(a_len, w), chunks(b_len, w)
    a = shard.rows[:, 0, shard.a_off[mi]: shard.a_off[mi] + rows * ca].reshape(CFG.num_layers, rows, ca * w)
    bt = shard.rows[:, 1, shard.b_off[mi]: shard.b_off[mi] + r * cb].reshape(CFG.num_layers, r, cb * w)
    return a[..., :a_len], bt[..., :b_len]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("rank", [1, 3, 8, 13])
def test_shares_reassemble_to_the_adapter(n, rank):
    layout = TPLayout(CFG, n)
    weights = random_adapter(CFG, "a", rank, ALL, seed=rank)
    full = pack_adapter(weights, CFG, CFG.kv_dim)
    shards = shard_adapter(weights, layout)
    for m in MODULES:
        a, bt = module_factors(full, CFG, m)
        parts = [shard_factors(s, layout, m) for s in shards]
        if m in COLUMN_MODULES:
            for k in range(rank):  # row k of A on rank k % n, local row k // n
                assert torch.equal(parts[k % n][0][:, k // n], a[:, k])
            for i, (a_part, _) in enumerate(parts):
                padding = a_part[:, len(range(i, rank, n)):]
                assert not padding.any(), "rows past a rank's share must be zero"
            assert torch.equal(torch.cat([p[1] for p in parts], dim=-1), bt)
        else:
            assert torch.equal(torch.cat([p[0] for p in parts], dim=-1), a)
            assert torch.equal(torch.cat([p[1] for p in parts], dim=-1), bt)


@pytest.mark.parametrize("n", [2, 4])
def test_no_weight_is_replicated_and_layout_is_rank_independent(n):
    cfg = dataclasses.replace(CFG, num_kv_heads=4)
    layout = TPLayout(cfg, n)
    weights = random_adapter(cfg, "a", 5, ALL, seed=1)
    full = pack_adapter(weights, cfg, cfg.kv_dim)
    shards = shard_adapter(weights, layout)
    assert len({(s.a_off, s.b_off, s.n_slots) for s in shards}) == 1
    assert all(s.rows.shape[-1] == cfg.kv_dim // n for s in shards)
    # Random values are nonzero, so counting nonzeros counts stored weight elements.
    assert sum(int(s.rows.count_nonzero()) for s in shards) == int(full.rows.count_nonzero())


def test_table_width_from_the_local_model_bounds_every_share():
    # Rank 0's ResidentAdapters sizes its table rows with the single-GPU formula on the shard's geometry.
    for n in (1, 2):
        layout = TPLayout(CFG, n)
        for r in (1, 7, 64):
            _, _, bound = layout_offsets((r,) * len(MODULES), layout.local_config(), layout.slot_width)
            assert shard_offsets((r,) * len(MODULES), layout)[2] <= bound


def test_share_is_cast_to_the_pool_dtype():
    layout = TPLayout(CFG, 2)
    shards = shard_adapter(random_adapter(CFG, "a", 4, ["q_proj"]), layout, torch.bfloat16)
    assert all(s.rows.dtype == torch.bfloat16 for s in shards)
