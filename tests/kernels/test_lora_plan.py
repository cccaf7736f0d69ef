"""A step's launch plan: the first layer's shrink and expand work out their launch, the other layers reuse it
with their own tensors and give exactly what a call worked out from scratch gives; a call of another shape
works out its own."""
from __future__ import annotations

import pytest
import torch
from conftest import ALIGNED_CFG, LoraPool

from services.gpu_worker.kernels import group_tokens_by_adapter, lora_expand, lora_shrink
from services.gpu_worker.kernels.compiled_launch import direct_calls, set_enabled
from services.gpu_worker.kernels.lora_groups import chunk_count
from services.gpu_worker.ops.meta import LoraTables
from shared.model_config import MODULES

QKV, O = (0, 1, 2), (3,)
# Compiled kernels where a GPU is, the interpreter (conftest) where none is.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def step_hints(token_adapter: torch.Tensor) -> dict:
    lengths = [n for n in torch.bincount(token_adapter.long() + 1).tolist() if n]
    groups = group_tokens_by_adapter(token_adapter, num_distinct=len(lengths), num_chunks=chunk_count(lengths))
    return {**groups.kwargs(), "max_seg_len": max(lengths)}


def test_layers_after_the_first_reuse_its_launch_and_match_a_fresh_one():
    layer0 = LoraPool(ALIGNED_CFG, torch.float32, seed=3)
    layer1 = LoraPool(ALIGNED_CFG, torch.float32, seed=4)  # same shapes, other rows: another layer's buffers
    bufs = [on_device(lp) for lp in (layer0, layer1)]
    tables = bufs[0][2]
    gen = torch.Generator().manual_seed(7)
    token_adapter = torch.cat([torch.full((90,), 0, dtype=torch.int32), torch.full((5,), -1, dtype=torch.int32),
                               torch.arange(layer0.num_adapters, dtype=torch.int32)])
    token_adapter = token_adapter[torch.randperm(token_adapter.shape[0], generator=gen)].contiguous()
    max_rank = layer0.max_rank(token_adapter, QKV)
    token_adapter = token_adapter.to(DEVICE)
    num_tokens = token_adapter.shape[0]
    hints = step_hints(token_adapter)
    fan_in = ALIGNED_CFG.module_dims(MODULES[0])[0]
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in QKV)
    plan: dict = {}
    first: dict = {}
    for k_buf, v_buf, _ in bufs:
        x = torch.randn(num_tokens, fan_in, generator=gen).to(DEVICE)
        base = torch.randn(num_tokens, sum(out_dims), generator=gen).to(DEVICE)
        y = lora_shrink(x, k_buf, token_adapter, tables, QKV, max_rank, plan=plan, **hints)
        out = base.clone()
        lora_expand(y, v_buf, token_adapter, tables, QKV, out, out_dims, plan=plan, **hints)
        fresh_y = lora_shrink(x, k_buf, token_adapter, tables, QKV, max_rank, **hints)
        fresh = base.clone()
        lora_expand(fresh_y, v_buf, token_adapter, tables, QKV, fresh, out_dims, **hints)
        assert torch.equal(y, fresh_y) and torch.equal(out, fresh)
        assert not torch.equal(out, base)  # the step's adapters did add something
        first = first or dict(plan)
    # One launch each, the first layer's, found again by the second (a miss would have added its own).
    assert sorted(k[0] for k in plan) == ["expand", "shrink"]
    assert all(plan[k] is first[k] for k in plan)
    # o's group is another shape: its own launch beside q,k,v's.
    attn = torch.randn(num_tokens, ALIGNED_CFG.module_dims(MODULES[3])[0], generator=gen).to(DEVICE)
    o_rank = layer0.max_rank(token_adapter.cpu(), O)
    k_buf = bufs[0][0]
    y = lora_shrink(attn, k_buf, token_adapter, tables, O, o_rank, plan=plan, **hints)
    assert torch.equal(y, lora_shrink(attn, k_buf, token_adapter, tables, O, o_rank, **hints))
    assert len(plan) == 3


def on_device(lp: LoraPool) -> tuple[torch.Tensor, torch.Tensor, LoraTables]:
    t = lp.tables
    tables = LoraTables(*(x.to(DEVICE) for x in (t.slots, t.ranks, t.a_off, t.b_off)))
    return lp.k_buf.to(DEVICE), lp.v_buf.to(DEVICE), tables


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_layers_launched_direct_match_ordinary_launches_bit_for_bit(dtype):
    layers = [LoraPool(ALIGNED_CFG, dtype, seed=s) for s in (3, 4, 5)]
    bufs = [on_device(lp) for lp in layers]
    tables = bufs[0][2]
    gen = torch.Generator().manual_seed(11)
    token_adapter = torch.cat([torch.full((150,), 2, dtype=torch.int32), torch.full((7,), -1, dtype=torch.int32),
                               torch.arange(layers[0].num_adapters, dtype=torch.int32).repeat(3)])
    token_adapter = token_adapter[torch.randperm(token_adapter.shape[0], generator=gen)].contiguous().cuda()
    num_tokens = token_adapter.shape[0]
    hints = step_hints(token_adapter)
    fan_in = ALIGNED_CFG.module_dims(MODULES[0])[0]
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in QKV)
    max_rank = layers[0].max_rank(token_adapter.cpu(), QKV)
    plan: dict = {}
    set_enabled(True)
    before = direct_calls()
    try:
        for i, (k_buf, v_buf, _) in enumerate(bufs * 2):
            x = torch.randn(num_tokens, fan_in, generator=gen).to("cuda", dtype)
            if i == 4:  # same shape and strides 2 bytes or more off a 16-byte boundary: the ordinary launch
                x = torch.empty(num_tokens * fan_in + 1, device="cuda", dtype=dtype)[1:].view(num_tokens, fan_in).copy_(x)
            base = torch.randn(num_tokens, sum(out_dims), generator=gen).to("cuda", dtype)
            y = lora_shrink(x, k_buf, token_adapter, tables, QKV, max_rank, plan=plan, **hints)
            out = base.clone()
            lora_expand(y, v_buf, token_adapter, tables, QKV, out, out_dims, plan=plan, **hints)
            fresh_y = lora_shrink(x, k_buf, token_adapter, tables, QKV, max_rank, **hints)
            fresh = base.clone()
            lora_expand(fresh_y, v_buf, token_adapter, tables, QKV, fresh, out_dims, **hints)
            assert torch.equal(y, fresh_y) and torch.equal(out, fresh), i
            assert not torch.equal(out, base)
        torch.cuda.synchronize()
    finally:
        set_enabled(False)
    # Five later layers, each at least a shrink and an expand launched direct (the shifted x's shrink not).
    assert direct_calls() - before >= 9
