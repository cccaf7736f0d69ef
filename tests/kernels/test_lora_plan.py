"""A step's launch plan: the first layer's shrink and expand work out their launch, the other layers reuse it
with their own tensors and give exactly what a call worked out from scratch gives; a call of another shape
works out its own."""
from __future__ import annotations

import torch
from conftest import ALIGNED_CFG, LoraPool

from services.gpu_worker.kernels import group_tokens_by_adapter, lora_expand, lora_shrink
from services.gpu_worker.kernels.lora_groups import chunk_count
from shared.model_config import MODULES

QKV, O = (0, 1, 2), (3,)


def step_hints(token_adapter: torch.Tensor) -> dict:
    lengths = [n for n in torch.bincount(token_adapter.long() + 1).tolist() if n]
    groups = group_tokens_by_adapter(token_adapter, num_distinct=len(lengths), num_chunks=chunk_count(lengths))
    return {**groups.kwargs(), "max_seg_len": max(lengths)}


def test_layers_after_the_first_reuse_its_launch_and_match_a_fresh_one():
    layer0 = LoraPool(ALIGNED_CFG, torch.float32, seed=3)
    layer1 = LoraPool(ALIGNED_CFG, torch.float32, seed=4)  # same shapes, other rows: another layer's buffers
    tables = layer0.tables
    gen = torch.Generator().manual_seed(7)
    token_adapter = torch.cat([torch.full((90,), 0, dtype=torch.int32), torch.full((5,), -1, dtype=torch.int32),
                               torch.arange(layer0.num_adapters, dtype=torch.int32)])
    token_adapter = token_adapter[torch.randperm(token_adapter.shape[0], generator=gen)].contiguous()
    num_tokens = token_adapter.shape[0]
    hints = step_hints(token_adapter)
    fan_in = ALIGNED_CFG.module_dims(MODULES[0])[0]
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in QKV)
    max_rank = layer0.max_rank(token_adapter, QKV)
    plan: dict = {}
    first: dict = {}
    for lp in (layer0, layer1):
        x = torch.randn(num_tokens, fan_in, generator=gen)
        base = torch.randn(num_tokens, sum(out_dims), generator=gen)
        y = lora_shrink(x, lp.k_buf, token_adapter, tables, QKV, max_rank, plan=plan, **hints)
        out = base.clone()
        lora_expand(y, lp.v_buf, token_adapter, tables, QKV, out, out_dims, plan=plan, **hints)
        fresh_y = lora_shrink(x, lp.k_buf, token_adapter, tables, QKV, max_rank, **hints)
        fresh = base.clone()
        lora_expand(fresh_y, lp.v_buf, token_adapter, tables, QKV, fresh, out_dims, **hints)
        assert torch.equal(y, fresh_y) and torch.equal(out, fresh)
        assert not torch.equal(out, base)  # the step's adapters did add something
        first = first or dict(plan)
    # One launch each, the first layer's, found again by the second (a miss would have added its own).
    assert sorted(k[0] for k in plan) == ["expand", "shrink"]
    assert all(plan[k] is first[k] for k in plan)
    # o's group is another shape: its own launch beside q,k,v's.
    attn = torch.randn(num_tokens, ALIGNED_CFG.module_dims(MODULES[3])[0], generator=gen)
    o_rank = layer0.max_rank(token_adapter, O)
    y = lora_shrink(attn, layer0.k_buf, token_adapter, tables, O, o_rank, plan=plan, **hints)
    assert torch.equal(y, lora_shrink(attn, layer0.k_buf, token_adapter, tables, O, o_rank, **hints))
    assert len(plan) == 3
