"""Base weights cut Megatron-style: put back together, the shards are the model; rank 0 alone keeps lm_head."""
from __future__ import annotations

import torch

from services.gpu_worker.tp.layout import TPLayout
from services.gpu_worker.tp.shard_weights import shard_weights
from services.gpu_worker.weights import dummy_weights
from shared.model_config import ModelConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=176, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)


def test_shards_reassemble_to_the_full_model():
    n = 2
    layout = TPLayout(CFG, n)
    full = dummy_weights(CFG, torch.float32, torch.device("cpu"), seed=1)
    shards = [shard_weights(full, layout, r) for r in range(n)]
    q, kv, inter = CFG.q_dim, CFG.kv_dim, CFG.intermediate_size
    for i, lw in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        # Fused q|k|v rows: each rank holds its q heads, then its k heads, then its v heads.
        lq, lkv = layout.q_dim, layout.kv_dim
        for t_full, t_parts in ((lw.qkv, [p.qkv for p in parts]), (lw.qkv_bias, [p.qkv_bias for p in parts])):
            assert torch.equal(torch.cat([p[:lq] for p in t_parts]), t_full[:q])
            assert torch.equal(torch.cat([p[lq:lq + lkv] for p in t_parts]), t_full[q:q + kv])
            assert torch.equal(torch.cat([p[lq + lkv:] for p in t_parts]), t_full[q + kv:])
        assert torch.equal(torch.cat([p.o for p in parts], dim=1), lw.o)
        li = layout.intermediate
        assert torch.equal(torch.cat([p.gate_up[:li] for p in parts]), lw.gate_up[:inter])
        assert torch.equal(torch.cat([p.gate_up[li:] for p in parts]), lw.gate_up[inter:])
        assert torch.equal(torch.cat([p.down for p in parts], dim=1), lw.down)
        assert all(p.qkv.shape == (lq + 2 * lkv, CFG.hidden_size) for p in parts)
    assert torch.equal(shards[0].lm_head, full.lm_head)
    assert shards[1].lm_head is None
    assert all(torch.equal(s.embed, full.embed) for s in shards)
