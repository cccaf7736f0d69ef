"""Triton LoRA shrink against ops.reference.lora_shrink on a real packed pool."""
from __future__ import annotations

import zlib

import pytest
import torch
from conftest import ALIGNED_CFG, LoraPool, assert_matches, launch_shapes_set
from lora_cases import FORMS, make_batch

from services.gpu_worker.kernels import group_tokens_by_adapter, lora_shrink
from services.gpu_worker.kernels.lora_shrink import (GRAPH_FEW_SHRINK_BLOCK_M, GRAPH_FEW_SHRINK_LONG_M,
                                                     GRAPH_SHRINK_MIN_SPLIT, ShrinkConfig, choose_shrink_config)
from services.gpu_worker.ops import reference
from shared.model_config import MODULES

GROUPS = {"qkv": (0, 1, 2), "gate_up": (4, 5), "down": (6,)}


def run_case(cfg, dtype, form, modules, seed, config=None, with_live=True):
    lp = LoraPool(cfg, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    token_adapter, kwargs = make_batch(form, lp.num_adapters, gen)
    if not with_live:
        kwargs.pop("num_live", None)
    fan_in = cfg.module_dims(MODULES[modules[0]])[0]
    x = torch.randn(token_adapter.shape[0], fan_in, generator=gen).to(dtype)
    max_rank = lp.max_rank(token_adapter, modules)
    ref = reference.lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank)
    out = torch.full_like(ref, float("nan"))
    got = lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank, out=out, config=config, **kwargs)
    assert got is out
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_shrink_matches_reference(model_cfg, dtype, form, group):
    run_case(model_cfg, dtype, form, GROUPS[group], seed=zlib.crc32(f"{form}/{group}".encode()) % 1000)


@pytest.mark.parametrize("form", FORMS)
def test_shrink_split_k_partials_sum_to_reference(form):
    # Three splits of the 48-wide input, 16-row rank tiles: the rank-64 adapter spans four tiles.
    config = ShrinkConfig(block_r=16, block_k=16, n_split=3, chunk_tokens=16 if form == "segments" else 0)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS["qkv"], seed=7, config=config)


def test_shrink_base_only_batch_is_all_zero():
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=3)
    x = torch.randn(5, ALIGNED_CFG.hidden_size)
    token_adapter = torch.full((5,), -1, dtype=torch.int32)
    out = torch.full((3, 5, 8), float("nan"))
    lora_shrink(x, lp.k_buf, token_adapter, lp.tables, (0, 1, 2), 8, out=out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(token_adapter=a["token_adapter"].long()), "token_adapter must have dtype torch.int32"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must have unit stride"),
    (lambda a: a.update(modules=(0, 1, 2, 3)), "modules must name 1 to 3 modules"),
    (lambda a: a.update(token_adapter=a["token_adapter"][:3]), "token_adapter has 3 entries but x has 5 tokens"),
    (lambda a: a.update(seg_start=torch.tensor([0, 5], dtype=torch.int32)), "seg_start was given without seg_adapter"),
])
def test_shrink_rejects_bad_arguments(mutate, message):
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=5)
    args = dict(x=torch.randn(5, ALIGNED_CFG.hidden_size), token_adapter=torch.zeros(5, dtype=torch.int32),
                modules=(0, 1, 2))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        lora_shrink(args.pop("x"), lp.k_buf, args.pop("token_adapter"), lp.tables, args.pop("modules"), 4, **args)


def test_shrink_prefill_token_tiles_wider_than_segments():
    # 32-token tiles over runs of 21, 3, 2, 4, 1 and 2 tokens: most of each tile is masked.
    config = ShrinkConfig(block_r=32, block_k=16, n_split=1, block_m=32, chunk_tokens=32)
    run_case(ALIGNED_CFG, torch.float16, "segments", GROUPS["gate_up"], seed=17, config=config)


def test_a_graph_plans_its_input_split_for_the_segments_that_carry_tokens():
    # A decode graph launches a segment per token (here 32) though a step may carry one adapter: counted as
    # 32 busy segments the 4096 inputs are not split at all, counted as one they are.
    common = dict(num_tokens=32, num_groups=3, fan_in=4096, width=128, max_rank=64, device=torch.device("cpu"),
                  segmented=True, num_segments=32)
    # Planned for every segment the split is the graphs' least one, not one that fills the GPU from 32 busy
    # segments; graph_shrink_split=1 keeps the split the segment count alone gives.
    assert choose_shrink_config(**common).n_split == GRAPH_SHRINK_MIN_SPLIT
    with launch_shapes_set("graph_shrink_split=1"):
        assert choose_shrink_config(**common).n_split == 1
    with launch_shapes_set("graph_shrink_split=8"):
        assert choose_shrink_config(**common).n_split == 8
    planned = choose_shrink_config(**common, live_segments=1)
    assert planned.n_split > GRAPH_SHRINK_MIN_SPLIT
    assert choose_shrink_config(**common, live_segments=64) == choose_shrink_config(**common)
    # Exact segment counts (eager steps) are planned as before.
    assert choose_shrink_config(**{**common, "num_segments": 1}) == planned


def test_the_few_adapter_graph_plan_sets_its_own_token_tiles():
    # A batch-512 decode graph of the few-adapter plan (32 live segments shared out among 32 programs):
    # graph_few_shrink_m sets its token tiles, and no other launch's.
    common = dict(num_tokens=512, num_groups=2, fan_in=4096, width=4096, max_rank=64, device=torch.device("cpu"),
                  segmented=True, num_segments=512)
    few = dict(live_segments=32, segment_programs=32)
    assert choose_shrink_config(**common, **few).block_m == GRAPH_FEW_SHRINK_BLOCK_M
    with launch_shapes_set("graph_few_shrink_m=64"):
        assert choose_shrink_config(**common, **few).block_m == 64
        assert choose_shrink_config(**common).block_m == 16  # a graph planned for every segment
        eager = choose_shrink_config(**{**common, "num_segments": 5, "max_seg_len": 110})
        assert (eager.block_m, eager.chunk_tokens) == (64, 64)  # an eager step's long segments, as before
        assert choose_shrink_config(**{**common, "num_segments": 100, "max_seg_len": 9}).block_m == 16
    assert choose_shrink_config(**common, **few).block_m == GRAPH_FEW_SHRINK_BLOCK_M
    # graph_few_chunk: each program takes 64-token chunks of its segments, in those graphs alone.
    assert choose_shrink_config(**common, **few).chunk_tokens == 0
    with launch_shapes_set("graph_few_chunk=64"):
        assert choose_shrink_config(**common, **few).chunk_tokens == 64
        assert choose_shrink_config(**common).chunk_tokens == 0


def test_graph_few_shrink_long_picks_the_tile_height_per_segment_in_few_adapter_graphs_alone():
    common = dict(num_tokens=512, num_groups=2, fan_in=4096, width=4096, max_rank=64, device=torch.device("cpu"),
                  segmented=True, num_segments=512)
    few = dict(live_segments=32, segment_programs=32)
    on = choose_shrink_config(**common, **few)  # on by default, from 16 tokens
    assert (on.block_m, on.block_m_long, on.long_from) == (GRAPH_FEW_SHRINK_BLOCK_M, GRAPH_FEW_SHRINK_LONG_M, 16)
    # Graphs planned for every segment and eager steps keep one height.
    assert choose_shrink_config(**common).block_m_long == 0
    assert choose_shrink_config(**{**common, "num_segments": 5, "max_seg_len": 110}).block_m_long == 0
    with launch_shapes_set("no_graph_few_shrink_long"):
        off = choose_shrink_config(**common, **few)
        assert (off.block_m, off.block_m_long, off.long_from) == (GRAPH_FEW_SHRINK_BLOCK_M, 0, 0)
    with launch_shapes_set("graph_few_shrink_long=32"):
        assert choose_shrink_config(**common, **few).long_from == 32
    with launch_shapes_set("graph_few_shrink_m=64"):
        assert choose_shrink_config(**common, **few).block_m_long == 0  # the short tiles are already that tall


@pytest.mark.parametrize("form", ["segments", "grouped"])
@pytest.mark.parametrize("n_split", [1, 3])
def test_shrink_segments_of_both_tile_heights_in_one_launch(form, n_split):
    # Runs of 21, 3, 2, 4, 1 and 2 tokens ("segments") or a decode batch grouped by adapter: parts of more than
    # 2 tokens go through 64-row tiles, the rest through 16-row ones, in one launch of two shared programs.
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=41)
    gen = torch.Generator().manual_seed(42)
    token_adapter, kwargs = make_batch(form, lp.num_adapters, gen)
    lengths = torch.diff(kwargs["seg_start"]).tolist()
    assert any(n > 2 for n in lengths) and any(0 < n <= 2 for n in lengths), lengths  # both heights are used
    chunk = 16 if form == "segments" else 0
    config = ShrinkConfig(block_r=16, block_k=16, n_split=n_split, block_m=16, chunk_tokens=chunk,
                          segment_programs=2, block_m_long=GRAPH_FEW_SHRINK_LONG_M, long_from=2)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS["qkv"], seed=41, config=config)


def test_a_prefill_of_few_long_prompts_reads_its_inputs_in_narrower_tiles():
    # An S2 admission step of 8687 tokens: over 5 adapters (1737 tokens a segment) 64-column input tiles,
    # over 100 (87 a segment) and in a decode step the widest the slot rows allow.
    common = dict(num_tokens=8687, num_groups=3, fan_in=4096, width=4096, max_rank=64, device=torch.device("cpu"),
                  segmented=True, num_segments=5, max_seg_len=2000)
    few = choose_shrink_config(**common)
    assert (few.block_k, few.block_m, few.chunk_tokens) == (64, 64, 64)
    many = choose_shrink_config(**{**common, "num_segments": 100, "max_seg_len": 504})
    assert (many.block_k, many.block_m) == (128, 64)
    assert choose_shrink_config(**{**common, "max_seg_len": None}).block_k == 128
    # Slot rows narrower than 64 columns keep their own width.
    assert choose_shrink_config(**{**common, "width": 32}).block_k == 32


def test_a_prefill_of_short_segments_plans_its_split_for_the_chunks_it_runs():
    # 4 multiprocessors on the CPU: a launch aims at 32 programs. A 100-token prompt (2 chunks) beside 3 decode
    # rows on other adapters, 103 tokens over 4 segments, on down's 11008 inputs in 2 rank tiles: counted as
    # every segment times the longest one's chunks that is 16 programs, so the inputs split 2 ways.
    short = dict(num_tokens=103, num_groups=1, fan_in=11008, width=4096, max_rank=64, device=torch.device("cpu"),
                 segmented=True, num_segments=4, max_seg_len=100)
    assert choose_shrink_config(**short).block_m == 16
    assert choose_shrink_config(**short).n_split == 2
    # The step lists the 5 chunks that hold tokens: 10 programs, so the inputs split 4 ways to give 32.
    assert choose_shrink_config(**short, chunk_programs=5).n_split == 4
    assert choose_shrink_config(**short, chunk_programs=8).n_split == 2  # as many as the old count: the same
    # Long segments (64-row tiles) keep the count over every segment: split further they measured slower.
    long = dict(short, num_tokens=8687, num_segments=100, max_seg_len=504)
    assert choose_shrink_config(**long).block_m == 64
    assert choose_shrink_config(**long, chunk_programs=101) == choose_shrink_config(**long)


def test_live_segments_change_the_launch_and_not_the_result():
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=23)
    gen = torch.Generator().manual_seed(24)
    token_adapter, kwargs = make_batch("grouped", lp.num_adapters, gen)
    x = torch.randn(token_adapter.shape[0], ALIGNED_CFG.hidden_size, generator=gen)
    modules = GROUPS["qkv"]
    max_rank = lp.max_rank(token_adapter, modules)
    ref = reference.lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank)
    bound = kwargs["seg_adapter"].shape[0]
    fan_in = ALIGNED_CFG.hidden_size
    # Without the graphs' least split (the tiny inputs allow two ways at most), so the plans differ.
    with launch_shapes_set("graph_shrink_split=1"):
        plans = {choose_shrink_config(x.shape[0], 3, fan_in, lp.k_buf.shape[1], max_rank, x.device, True, None,
                                      bound, live).n_split for live in (None, 1)}
    assert len(plans) == 2  # one split for the bound, another for a single live segment
    for live in (None, 1):
        got = lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank, live_segments=live, **kwargs)
        assert_matches(got, ref, torch.float32)


@pytest.mark.parametrize("n_split,block_m", [(1, 16), (3, 16), (3, 64)])
@pytest.mark.parametrize("form,with_live", [("grouped", True), ("grouped", False), ("segments", False)])
def test_shrink_segments_shared_out_among_fewer_programs(form, with_live, n_split, block_m):
    # Two programs take every segment between them, stopping at the count on the device when there is one;
    # base-only tokens still get their zeros. 64-token tiles (graph_few_shrink_m) are mostly masked here.
    chunk = 16 if form == "segments" else 0
    config = ShrinkConfig(block_r=16, block_k=16, n_split=n_split, block_m=block_m, chunk_tokens=chunk,
                          segment_programs=2)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS["qkv"], seed=31, config=config, with_live=with_live)


@pytest.mark.parametrize("group", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("programs,live_bound,long_from,n_split", [(1, 8, 0, 1), (3, 8, 0, 3), (3, 8, 16, 1),
                                                                   (5, 4, 16, 3), (3, 2, 16, 1)])
def test_shrink_tiles_dealt_to_the_programs_give_the_same_bits_as_whole_segments(group, programs, live_bound,
                                                                                 long_from, n_split):
    # A decode graph's segment per token, four of them busy (a base-only one included), 5-37 tokens each: dealt
    # or walked, each tile of either height is summed by one program over the same input steps, so the
    # outputs agree bit for bit, and with the reference. A bound below the busy segments (2) walks them.
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=45)
    gen = torch.Generator().manual_seed(46)
    counts = {-1: 5, 0: 37, 1: 20, 2: 19}
    ids = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in counts.items()])
    token_adapter = ids[torch.randperm(ids.shape[0], generator=gen)].contiguous()
    modules = GROUPS[group]
    kwargs = {**group_tokens_by_adapter(token_adapter, count_live=True).kwargs(), "live_segments": live_bound}
    x = torch.randn(token_adapter.shape[0], ALIGNED_CFG.module_dims(MODULES[modules[0]])[0], generator=gen)
    max_rank = lp.max_rank(token_adapter, modules)
    outs = []
    for deal in (False, True):
        config = ShrinkConfig(block_r=16, block_k=16, n_split=n_split, block_m=16, segment_programs=programs,
                              block_m_long=GRAPH_FEW_SHRINK_LONG_M if long_from else 0, long_from=long_from,
                              deal_tiles=deal)
        outs.append(lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank, config=config, **kwargs))
    assert torch.equal(outs[0], outs[1])
    ref = reference.lora_shrink(x, lp.k_buf, token_adapter, lp.tables, modules, max_rank)
    assert_matches(outs[1], ref, torch.float32)


def test_a_few_adapter_graph_deals_its_shrink_tiles_when_asked():
    common = dict(num_tokens=512, num_groups=2, fan_in=4096, width=4096, max_rank=64, device=torch.device("cpu"),
                  segmented=True, num_segments=512)
    few = dict(live_segments=32, segment_programs=32)
    assert not choose_shrink_config(**common, **few).deal_tiles
    with launch_shapes_set("graph_few_shrink_deal,graph_few_chunk=64"):
        dealt = choose_shrink_config(**common, **few)
        assert dealt.deal_tiles and dealt.chunk_tokens == 0 and dealt.block_m_long == GRAPH_FEW_SHRINK_LONG_M
        assert not choose_shrink_config(**common).deal_tiles
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=47)
    token_adapter = torch.tensor([0, 1, 0, 2] * 8, dtype=torch.int32)
    x = torch.randn(32, ALIGNED_CFG.module_dims(MODULES[0])[0])
    config = ShrinkConfig(block_r=16, block_k=16, n_split=1, chunk_tokens=16, segment_programs=2, deal_tiles=True)
    with pytest.raises(ValueError, match="deal_tiles"):
        lora_shrink(x, lp.k_buf, token_adapter, lp.tables, GROUPS["qkv"], 64, config=config, live_segments=8,
                    **group_tokens_by_adapter(token_adapter, count_live=True).kwargs())
