"""How the model is cut: which splits are accepted, and the clear refusal of the ones that are not."""
from __future__ import annotations

import dataclasses

import pytest

from services.gpu_worker.tp.layout import TPLayout, TPLayoutError
from shared.model_config import ModelConfig

LLAMA2_7B = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128)
LLAMA3_8B = dataclasses.replace(LLAMA2_7B, vocab_size=128256, intermediate_size=14336, num_kv_heads=8)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_gqa_pool_shard_holds_whole_kv_heads(n):
    layout = TPLayout(LLAMA3_8B, n)
    assert layout.kv_heads == 8 // n
    assert layout.slot_width == (8 // n) * 128
    assert layout.heads == 32 // n
    local = layout.local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (32 // n, 8 // n, 14336 // n)
    assert local.hidden_size == 4096 and local.kv_dim == layout.slot_width


def test_slices_tile_every_feature_once():
    layout = TPLayout(LLAMA3_8B, 4)
    for cols in (layout.q_cols, layout.kv_cols, layout.inter_cols, layout.hidden_cols):
        covered = [i for r in range(4) for i in range(cols(r).start, cols(r).stop)]
        assert covered == list(range(len(covered)))
    assert layout.kv_cols(3).stop == LLAMA3_8B.kv_dim and layout.hidden_cols(3).stop == 4096


def test_more_ranks_than_kv_heads_is_refused_naming_the_gqa_constraint():
    with pytest.raises(TPLayoutError, match=r"cannot split 8 KV heads over 16 ranks.*num_key_value_heads % tp == 0"
                                            r".*GQA.*use tp in \[1, 2, 4, 8\]"):
        TPLayout(LLAMA3_8B, 16)


def test_indivisible_intermediate_is_refused():
    cfg = dataclasses.replace(LLAMA2_7B, intermediate_size=11009)
    with pytest.raises(TPLayoutError, match="intermediate_size 11009 over 2 ranks"):
        TPLayout(cfg, 2)


def test_column_parallel_adapter_rows_are_dealt_round_robin():
    layout = TPLayout(LLAMA2_7B, 4)
    assert [layout.shrink_rank("q_proj", r) for r in (1, 4, 5, 16, 64)] == [1, 1, 2, 4, 16]
    assert layout.shrink_rank("o_proj", 5) == 5 and layout.shrink_rank("down_proj", 5) == 5
