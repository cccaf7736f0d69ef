"""A prefill step's chunk list: shrink and expand launched one program per (segment, chunk) that holds tokens
give exactly what the launch over every segment times the longest one's chunks gives, and the reference."""
from __future__ import annotations

import pytest
import torch
from conftest import ALIGNED_CFG, LoraPool, assert_matches

from services.gpu_worker.kernels import group_tokens_by_adapter, lora_expand, lora_shrink
from services.gpu_worker.kernels.lora_expand import ExpandConfig
from services.gpu_worker.kernels.lora_groups import PREFILL_CHUNK_TOKENS, ChunkItems, chunk_count
from services.gpu_worker.kernels.lora_rows import segment_launch
from services.gpu_worker.kernels.lora_shrink import ShrinkConfig
from services.gpu_worker.ops import reference
from shared.model_config import MODULES

QKV = (0, 1, 2)


def admission_step(gen: torch.Generator) -> torch.Tensor:
    """Adapter ids of a prefill step's tokens, in batch order: two long prompts (one longer than two
    chunks), a base-only prompt, and one-token decode requests on other adapters, interleaved."""
    runs = [(2, 150), (0, 70), (-1, 40)] + [(a, 1) for a in (1, 3, 0, 1, -1, 3)]
    ids = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in runs])
    return ids[torch.randperm(ids.shape[0], generator=gen)].contiguous()


def grouped(token_adapter: torch.Tensor, with_items: bool):
    lengths = torch.bincount(token_adapter.long() + 1).tolist()
    lengths = [n for n in lengths if n]
    num_chunks = chunk_count(lengths) if with_items else None
    groups = group_tokens_by_adapter(token_adapter, num_distinct=len(lengths), num_chunks=num_chunks)
    return groups, {**groups.kwargs(), "max_seg_len": max(lengths)}


def test_the_chunk_list_names_every_chunk_that_holds_tokens_once():
    token_adapter = admission_step(torch.Generator().manual_seed(1))
    groups, _ = grouped(token_adapter, with_items=True)
    starts = groups.seg_start.tolist()
    expected = [(s, c) for s in range(len(starts) - 1)
                for c in range(-(-(starts[s + 1] - starts[s]) // PREFILL_CHUNK_TOKENS))]
    assert [tuple(p) for p in groups.chunk_items.table.T.tolist()] == expected
    # Adapter 2's 150 tokens are 3 chunks, adapter 0's 71 are 2, the 41 base-only ones 1, adapters 1 and 3 1 each.
    assert groups.chunk_items.count == chunk_count([150, 71, 41, 2, 2]) == 3 + 2 + 1 + 1 + 1
    assert groups.kwargs()["chunk_items"] is groups.chunk_items
    assert "chunk_items" not in grouped(token_adapter, with_items=False)[0].kwargs()


# Shrink reads (block_m, n_split) and expand (block_m, tiles, cols_first): these six cases give each kernel
# every one of its own combinations, at half the interpreter's time of the full cross product.
@pytest.mark.parametrize("block_m, n_split, tiles, cols_first", [
    (16, 1, 1, False), (16, 3, 2, False), (16, 1, 2, True),
    (64, 3, 1, False), (64, 1, 2, False), (64, 3, 2, True),
], ids=["m16-whole-one-tile", "m16-split-two-tile", "m16-whole-cols-first",
        "m64-split-one-tile", "m64-whole-two-tile", "m64-split-cols-first"])
def test_shrink_and_expand_over_the_chunk_list_equal_the_full_launch(n_split, block_m, tiles, cols_first):
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    token_adapter = admission_step(gen)
    num_tokens = token_adapter.shape[0]
    fan_in = ALIGNED_CFG.module_dims(MODULES[0])[0]
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in QKV)
    max_rank = lp.max_rank(token_adapter, QKV)
    x = torch.randn(num_tokens, fan_in, generator=gen)
    base = torch.randn(num_tokens, sum(out_dims), generator=gen)
    shrink_cfg = ShrinkConfig(block_r=16, block_k=16, n_split=n_split, block_m=block_m,
                              chunk_tokens=PREFILL_CHUNK_TOKENS)
    expand_cfg = ExpandConfig(block_r=16, block_n=16, block_m=block_m, chunk_tokens=PREFILL_CHUNK_TOKENS,
                              tiles_per_prog=tiles, cols_first=cols_first)
    results = {}
    for with_items in (False, True):
        _, kwargs = grouped(token_adapter, with_items)
        # NaN where nothing writes: a token the chunk list left out would show.
        y = lora_shrink(x, lp.k_buf, token_adapter, lp.tables, QKV, max_rank, config=shrink_cfg,
                        out=torch.full((3, num_tokens, max_rank), float("nan")), **kwargs)
        out = base.clone()
        lora_expand(y, lp.v_buf, token_adapter, lp.tables, QKV, out, out_dims, config=expand_cfg, **kwargs)
        results[with_items] = (y, out)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    ref_y = reference.lora_shrink(x, lp.k_buf, token_adapter, lp.tables, QKV, max_rank)
    ref = base.clone()
    reference.lora_expand(ref_y, lp.v_buf, token_adapter, lp.tables, QKV, ref, out_dims)
    assert_matches(results[True][0], ref_y, torch.float32)
    assert_matches(results[True][1] - base, ref - base, torch.float32)


def test_only_a_launch_of_the_lists_chunk_size_that_gives_each_segment_a_program_reads_it():
    table = torch.tensor([[0, 1, 1, 2], [0, 0, 1, 0]], dtype=torch.int32)
    items = ChunkItems(table, 64)
    cpu = torch.device("cpu")
    assert segment_launch(3, 150, 64, False, items, cpu) == (4, 1, table)
    assert segment_launch(3, 150, 64, False, None, cpu) == (3, 3, None)
    # Another chunk size, or programs sharing segments out (a CUDA graph's launch): the full grid.
    assert segment_launch(3, 150, 32, False, items, cpu) == (3, 5, None)
    assert segment_launch(2, 150, 64, True, items, cpu) == (2, 3, None)
    with pytest.raises(ValueError, match=r"\[2, N\]"):
        segment_launch(3, 150, 64, False, ChunkItems(torch.zeros(3, 4, dtype=torch.int32), 64), cpu)


def test_a_prefill_step_gets_its_chunk_list_and_a_decode_step_none():
    from services.gpu_worker.ops.meta import LoraBatch, LoraTables
    from services.gpu_worker.ops.triton_backend import prepare_lora

    rows = torch.zeros(8, 7, dtype=torch.int32)
    tables = LoraTables(slots=torch.zeros(8, 4, dtype=torch.int32), ranks=rows, a_off=rows, b_off=rows)
    token_adapter = torch.tensor([3] * 100 + [-1] * 3 + [0], dtype=torch.int32)
    prefill = LoraBatch(tables=tables, token_adapter=token_adapter, max_rank=(8,) * 7, segment_lengths=(100, 3, 1))
    prepare_lora(prefill)
    assert prefill.kernel_args["chunk_items"].table.tolist() == [[0, 1, 2, 2], [0, 0, 0, 1]]
    decode = LoraBatch(tables=tables, token_adapter=token_adapter[100:], max_rank=(8,) * 7, segment_lengths=(3, 1))
    prepare_lora(decode)  # no segment longer than a chunk: nothing to list
    assert "chunk_items" not in decode.kernel_args
