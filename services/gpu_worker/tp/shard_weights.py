"""Cut the base model's weights into one rank's shard.

Column-parallel q/k/v and gate/up keep the rows (output features) of this rank's heads and intermediate
slice; row-parallel o and down keep the matching columns (input features). Norms and the embedding are
replicated (the embedding lookup then needs no collective); the lm_head lives on rank 0 only, which samples:
followers never compute logits, so no logits gather is needed and the followers save the vocab × hidden
matrix (with tied embeddings rank 0 pays nothing extra either).
"""
from __future__ import annotations

import torch

from ..weights import LayerWeights, ModelWeights
from .layout import TPLayout


def _take(t: torch.Tensor) -> torch.Tensor:
    # A copy, so the full tensor it was cut from can be freed.
    return t.contiguous().clone()


def shard_layer(lw: LayerWeights, layout: TPLayout, rank: int) -> LayerWeights:
    q_dim, kv_dim, inter = layout.cfg.q_dim, layout.cfg.kv_dim, layout.cfg.intermediate_size
    q, kv, ic = layout.q_cols(rank), layout.kv_cols(rank), layout.inter_cols(rank)

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[q], t[q_dim:][kv], t[q_dim + kv_dim:][kv]])

    return LayerWeights(
        input_norm=lw.input_norm,
        qkv=_take(qkv_rows(lw.qkv)),
        qkv_bias=None if lw.qkv_bias is None else _take(qkv_rows(lw.qkv_bias)),
        o=_take(lw.o[:, q]),
        post_norm=lw.post_norm,
        gate_up=_take(torch.cat([lw.gate_up[ic], lw.gate_up[inter:][ic]])),
        down=_take(lw.down[:, ic]),
    )


def shard_weights(full: ModelWeights, layout: TPLayout, rank: int) -> ModelWeights:
    """Rank `rank`'s shard; followers get `lm_head = None`. Shards are copies: drop `full` afterwards and
    only the shard (plus the replicated embedding and norms) stays in memory."""
    if not 0 <= rank < layout.size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {layout.size}")
    layers = [shard_layer(lw, layout, rank) for lw in full.layers]
    return ModelWeights(embed=full.embed, layers=layers, final_norm=full.final_norm,
                        lm_head=full.lm_head if rank == 0 else None)


def load_shard(source: dict, layout: TPLayout, rank: int, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """This rank's shard from `{"model_dir": path}` (an HF checkpoint) or `{"dummy_seed": n}` (random weights
    of real shapes, the same values on every rank and as a single-GPU engine with that seed)."""
    from ..weights import dummy_weights, load_weights

    if "model_dir" in source:
        full = load_weights(source["model_dir"], layout.cfg, dtype, device)
    elif "dummy_seed" in source:
        full = dummy_weights(layout.cfg, dtype, device, int(source["dummy_seed"]))
    else:
        raise ValueError(f"weights source needs model_dir or dummy_seed, got {sorted(source)}")
    shard = shard_weights(full, layout, rank)
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return shard
