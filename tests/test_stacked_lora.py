"""The few-adapter LoRA as dense products (ops.stacked_lora) gives the reference ops' result on the pool."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config
from services.gpu_worker.ops import reference
from services.gpu_worker.ops.stacked_lora import stack_mask, stack_rows, stacked_lora, stacked_positions


def pool_with_zero_slot(ranks, seed=0):
    cfg = llama_config("tiny")
    pool = AdapterPool(cfg, ranks, torch.float32, "cpu", spare_slots=1, seed=seed)
    zero = int(pool.spare[0])
    pool.kv[:, :, zero] = 0.0
    return cfg, pool, zero


def reference_delta(pool, x, token_adapter, modules, out_dims):
    y = reference.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64)
    out = torch.zeros(x.shape[0], sum(out_dims))
    reference.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims)
    return out


@pytest.mark.parametrize("group", list(GROUPS))
def test_stacked_products_equal_the_reference_over_mixed_ranks_and_base_only_tokens(group):
    cfg, pool, zero = pool_with_zero_slot([8, 16, 4, 32, 8])
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    gen = torch.Generator().manual_seed(1)
    # Tokens of three of the five adapters, in no order, and base-only tokens among them.
    token_adapter = torch.tensor([3, -1, 1, 3, 4, 1, -1, 3, 4, 4, 1, 3], dtype=torch.int32)
    adapters = [4, 1, 3]
    x = torch.randn(len(token_adapter), fan_in, generator=gen)
    base = torch.randn(len(token_adapter), sum(out_dims), generator=gen)
    rows = stack_rows(pool.tables, adapters, modules, fan_in, out_dims, pool.width, zero)
    assert rows.columns == 8 + 16 + 32
    out = base.clone()
    keep = stack_mask(stacked_positions(token_adapter, adapters), rows.owner, x.dtype)
    stacked_lora(x, pool.k(), pool.v(), keep, rows, out)
    want = reference_delta(pool, x, token_adapter, modules, out_dims)
    torch.testing.assert_close(out - base, want, rtol=1e-4, atol=1e-5)
    assert want.abs().max() > 0 and (out - base)[token_adapter < 0].abs().max() == 0


def test_padded_columns_and_an_unadapted_module_add_nothing_of_their_own():
    cfg, pool, zero = pool_with_zero_slot([8, 16, 4])
    modules = GROUPS["qkv"]
    pool.tables.ranks[1, modules[1]] = 0  # adapter 1 leaves k unadapted
    fan_in, out_dims = cfg.group_dims(modules)
    token_adapter = torch.tensor([1, 0, 2, 1, 0], dtype=torch.int32)
    x = torch.randn(5, fan_in, generator=torch.Generator().manual_seed(2))
    rows = stack_rows(pool.tables, [0, 1, 2], modules, fan_in, out_dims, pool.width, zero, columns=64)
    assert rows.columns == 64 and (rows.owner[28:] == -1).all() and rows.owner[:28].tolist() == [0] * 8 + [1] * 16 + [2] * 4
    out = torch.zeros(5, sum(out_dims))
    keep = stack_mask(stacked_positions(token_adapter, [0, 1, 2]), rows.owner, x.dtype)
    stacked_lora(x, pool.k(), pool.v(), keep, rows, out)
    torch.testing.assert_close(out, reference_delta(pool, x, token_adapter, modules, out_dims), rtol=1e-4, atol=1e-5)
    k_cols = slice(out_dims[0], out_dims[0] + out_dims[1])
    assert out[token_adapter == 1][:, k_cols].abs().max() == 0 and out[token_adapter == 0][:, k_cols].abs().max() > 0


def test_too_few_columns_and_mismatched_dims_are_refused():
    cfg, pool, zero = pool_with_zero_slot([8, 16])
    fan_in, out_dims = cfg.group_dims(GROUPS["o"])
    with pytest.raises(ValueError, match="columns=16 cannot hold these adapters' rows side by side \\(24 needed\\)"):
        stack_rows(pool.tables, [0, 1], GROUPS["o"], fan_in, out_dims, pool.width, zero, columns=16)
    with pytest.raises(ValueError, match="adapter 1 has rank 16 for module 3, wider than its 8 columns"):
        stack_rows(pool.tables, [0, 1], GROUPS["o"], fan_in, out_dims, pool.width, zero, widths=[8, 8])
    with pytest.raises(ValueError, match="out_dims has 2 entries for 1 modules"):
        stack_rows(pool.tables, [0, 1], GROUPS["o"], fan_in, out_dims * 2, pool.width, zero)


def test_positions_map_resident_ids_to_the_stack_and_the_rest_to_none():
    token_adapter = torch.tensor([7, -1, 2, 9, 2, 0], dtype=torch.int32)
    assert stacked_positions(token_adapter, [2, 7]).tolist() == [1, -1, 0, -1, 0, -1]
    assert stacked_positions(token_adapter, []).tolist() == [-1] * 6


def test_groups_laid_out_with_one_width_an_adapter_share_one_mask():
    # Widths wider than a group's ranks (each adapter's widest over every module) leave the group's extra columns
    # on the zero slot: the same result, and the same owner for every group.
    cfg, pool, zero = pool_with_zero_slot([8, 16, 4])
    pool.tables.ranks[0, GROUPS["o"][0]] = 0  # adapter 0 leaves o unadapted, so its widest o rank is 0
    token_adapter = torch.tensor([0, 2, 1, -1, 0], dtype=torch.int32)
    positions = stacked_positions(token_adapter, [0, 1, 2])
    owners = []
    for group in ("qkv", "o"):
        modules = GROUPS[group]
        fan_in, out_dims = cfg.group_dims(modules)
        rows = stack_rows(pool.tables, [0, 1, 2], modules, fan_in, out_dims, pool.width, zero, 32, widths=[8, 16, 4])
        x = torch.randn(5, fan_in, generator=torch.Generator().manual_seed(3))
        out = torch.zeros(5, sum(out_dims))
        stacked_lora(x, pool.k(), pool.v(), stack_mask(positions, rows.owner, x.dtype), rows, out)
        torch.testing.assert_close(out, reference_delta(pool, x, token_adapter, modules, out_dims), rtol=1e-4, atol=1e-5)
        owners.append(rows.owner.tolist())
    assert owners[0] == owners[1] == [0] * 8 + [1] * 16 + [2] * 4 + [-1] * 4
