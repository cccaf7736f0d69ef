"""Triton LoRA expand against ops.reference.lora_expand on a real packed pool: in place, fused groups."""
from __future__ import annotations

import zlib

import pytest
import torch
from conftest import ALIGNED_CFG, LoraPool, assert_matches, launch_shapes_set
from lora_cases import FORMS, make_batch

from services.gpu_worker.kernels import group_tokens_by_adapter, lora_expand
from services.gpu_worker.kernels.lora_expand import ExpandConfig
from services.gpu_worker.ops import reference
from shared.model_config import MODULES

GROUPS = {"qkv": (0, 1, 2), "gate_up": (4, 5), "down": (6,)}


def run_case(cfg, dtype, form, modules, seed, config=None, with_live=True):
    lp = LoraPool(cfg, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    token_adapter, kwargs = make_batch(form, lp.num_adapters, gen)
    if not with_live:
        kwargs.pop("num_live", None)
    num_tokens = token_adapter.shape[0]
    out_dims = tuple(cfg.module_dims(MODULES[m])[1] for m in modules)
    max_rank = lp.max_rank(token_adapter, modules)
    # Random y beyond each adapter's rank too: the kernel must not read past the rank.
    y = torch.randn(len(modules), num_tokens, max_rank, generator=gen).to(dtype)
    base = torch.randn(num_tokens, sum(out_dims), generator=gen).to(dtype)
    ref = base.clone()
    reference.lora_expand(y, lp.v_buf, token_adapter, lp.tables, modules, ref, out_dims)
    out = base.clone()
    lora_expand(y, lp.v_buf, token_adapter, lp.tables, modules, out, out_dims, config=config, **kwargs)
    assert_matches(out - base, ref - base, dtype)
    untouched = token_adapter < 0
    assert torch.equal(out[untouched], base[untouched]), "base-only tokens' outputs changed"


def same_bits_under(configs, lp, token_adapter, modules, kwargs, gen) -> None:
    """Launches that only reshape the work (which program takes which tile, in what order) add the same bits to
    the output under every config, and match the reference; base-only tokens' outputs stay as they were."""
    out_dims = tuple(lp.cfg.module_dims(MODULES[m])[1] for m in modules)
    max_rank = lp.max_rank(token_adapter, modules)
    y = torch.randn(len(modules), token_adapter.shape[0], max_rank, generator=gen)
    base = torch.randn(token_adapter.shape[0], sum(out_dims), generator=gen)
    outs = []
    for config in configs:
        out = base.clone()
        lora_expand(y, lp.v_buf, token_adapter, lp.tables, modules, out, out_dims, config=config, **kwargs)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    ref = base.clone()
    reference.lora_expand(y, lp.v_buf, token_adapter, lp.tables, modules, ref, out_dims)
    assert_matches(outs[0] - base, ref - base, torch.float32)
    untouched = token_adapter < 0
    assert torch.equal(outs[0][untouched], base[untouched]), "base-only tokens' outputs changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_expand_matches_reference(model_cfg, dtype, form, group):
    run_case(model_cfg, dtype, form, GROUPS[group], seed=zlib.crc32(f"{form}/{group}".encode()) % 1000)


@pytest.mark.parametrize("form", FORMS)
def test_expand_narrow_tiles_and_rank_blocks(form):
    # 16-column tiles and 16-row rank blocks: several tiles per module, a rank loop for rank 64, and column
    # groups of three tiles (the last group of a module partly past its end).
    config = ExpandConfig(block_r=16, block_n=16, tiles_per_prog=3, chunk_tokens=16 if form == "segments" else 0)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS["qkv"], seed=11, config=config)


SEGMENT_FORMS = [f for f in FORMS if f != "token"]


@pytest.mark.parametrize("form", SEGMENT_FORMS)
@pytest.mark.parametrize("group", ["qkv", "down"])
def test_expand_whole_rank_a_step_over_pipelined_column_tiles(form, group):
    # rank_whole: one 64-row step covers every rank (1, 7 and 64 here), the column tiles the inner loop; three
    # 16-column tiles a program, the last group of a module partly past its end; ranks below 64 read no rows
    # past their own (the pool holds other adapters' rows there).
    config = ExpandConfig(block_r=64, block_n=16, tiles_per_prog=3, chunk_tokens=16 if form == "segments" else 0,
                          rank_whole=True)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS[group], seed=41, config=config)


def test_expand_whole_rank_needs_a_step_covering_the_batch_ranks():
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=43)
    gen = torch.Generator().manual_seed(44)
    token_adapter, kwargs = make_batch("grouped", lp.num_adapters, gen)
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in GROUPS["qkv"])
    y = torch.randn(3, token_adapter.shape[0], 64, generator=gen)
    out = torch.zeros(token_adapter.shape[0], sum(out_dims))
    config = ExpandConfig(block_r=32, block_n=16, rank_whole=True)
    with pytest.raises(ValueError, match="rank_whole: block_r 32 is below the batch's max rank 64"):
        lora_expand(y, lp.v_buf, token_adapter, lp.tables, GROUPS["qkv"], out, out_dims, config=config, **kwargs)
    assert not out.any()


def test_expand_writes_into_a_column_view_of_a_wider_output():
    # The fused projection output is often a view: row stride wider than the q,k,v columns.
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=13)
    token_adapter = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    out_dims = (32, 16, 16)
    y = torch.randn(3, 5, 64)
    wide = torch.randn(5, 100)
    ref = wide.clone()
    reference.lora_expand(y, lp.v_buf, token_adapter, lp.tables, (0, 1, 2), ref[:, 10:74], out_dims)
    lora_expand(y, lp.v_buf, token_adapter, lp.tables, (0, 1, 2), wide[:, 10:74], out_dims)
    assert_matches(wide, ref, torch.float32)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(out_dims=(32, 16)), r"out_dims \(32, 16\) must give one width per module"),
    (lambda a: a.update(out_dims=(32, 16, 17)), "out has 64 columns but out_dims sum to 65"),
    (lambda a: a.update(y=a["y"][:, :3]), r"y must be \[3, 5, max_rank\]"),
    (lambda a: a.update(v_buf=a["v_buf"].to(torch.int8)), "v_buf must have dtype"),
])
def test_expand_rejects_bad_arguments(mutate, message):
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=5)
    args = dict(y=torch.randn(3, 5, 4), v_buf=lp.v_buf, out_dims=(32, 16, 16))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        lora_expand(args["y"], args["v_buf"], torch.zeros(5, dtype=torch.int32), lp.tables, (0, 1, 2),
                    torch.zeros(5, 64), args["out_dims"])


def test_expand_prefill_token_tiles_wider_than_segments():
    config = ExpandConfig(block_r=32, block_n=16, block_m=32, chunk_tokens=32)
    run_case(ALIGNED_CFG, torch.float16, "segments", GROUPS["gate_up"], seed=19, config=config)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("form,with_live", [("grouped", True), ("grouped", False), ("segments", False)])
def test_expand_segments_shared_out_among_fewer_programs(form, with_live, block_m):
    # Two programs take every segment between them, stopping at the count on the device when there is one;
    # 64-row tiles (graph_live_segments' "em64" in a few-adapter graph) are mostly masked here.
    chunk = 16 if form == "segments" else 0
    config = ExpandConfig(block_r=16, block_n=16, block_m=block_m, chunk_tokens=chunk, segment_programs=2)
    run_case(ALIGNED_CFG, torch.float32, form, GROUPS["qkv"], seed=29, config=config, with_live=with_live)


@pytest.mark.parametrize("form, programs", [("token", 0), ("grouped", 0), ("grouped", 2), ("segments", 0)])
def test_expand_launched_column_tile_first_adds_the_same_bits(form, programs):
    # Only the order programs start in changes: every program still owns its tiles and sums its rank rows in the
    # same order, so the outputs agree bit for bit (also with the segments shared out among fewer programs).
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=37)
    gen = torch.Generator().manual_seed(38)
    token_adapter, kwargs = make_batch(form, lp.num_adapters, gen)
    configs = [ExpandConfig(block_r=16, block_n=16, tiles_per_prog=2, chunk_tokens=16 if form == "segments" else 0,
                            segment_programs=programs, cols_first=first) for first in (False, True)]
    same_bits_under(configs, lp, token_adapter, GROUPS["qkv"], kwargs, gen)


def test_a_graphs_launch_walks_several_column_tiles_a_program():
    from services.gpu_worker.kernels.lora_expand import GRAPH_WIDE_TILES, choose_expand_config

    # A decode graph's launch of 256 tokens (a segment per token, max_seg_len unknown): several column tiles a
    # program, so fewer programs find their segment empty: four for q,k,v's 96 tiles, two for o's 32. An eager
    # step's exact segments, and a graph whose programs share the segments out, keep one; so does an output of
    # a single tile.
    common = dict(num_tokens=256, num_groups=3, out_dims=(4096, 4096, 4096), width=4096, max_rank=64,
                  device=torch.device("cpu"), segmented=True, num_segments=256)
    graph = choose_expand_config(**common)
    assert 3 * 4096 // 128 >= GRAPH_WIDE_TILES > 4096 // 128
    assert graph.tiles_per_prog == 4 and graph.block_n == 128
    assert choose_expand_config(**{**common, "num_groups": 1, "out_dims": (4096,)}).tiles_per_prog == 2
    # kernel_shapes' graph_expand_tiles sets it, up to the tiles there are.
    with launch_shapes_set("graph_expand_tiles=2"):
        assert choose_expand_config(**common).tiles_per_prog == 2
    with launch_shapes_set("graph_expand_tiles=64"):
        assert choose_expand_config(**common).tiles_per_prog == 4096 // 128
    # expand_rank_whole: the batch's whole rank a step, in the graphs planned for every segment only.
    with launch_shapes_set("expand_rank_whole"):
        whole = choose_expand_config(**common)
        assert (whole.rank_whole, whole.block_r, whole.tiles_per_prog) == (True, 64, 4)
        assert choose_expand_config(**{**common, "max_rank": 16}).block_r == 16
        assert not choose_expand_config(**common, live_segments=32, segment_programs=32).rank_whole
        assert not choose_expand_config(**common, max_seg_len=3).rank_whole
    # Its ranks are stepped 16 rows at a time (many adapters' mixed ranks); a few-adapter graph's programs,
    # which share the segments out, keep 32-row steps.
    assert graph.block_r == 16
    assert choose_expand_config(**common, live_segments=32, segment_programs=32).block_r == 32
    assert choose_expand_config(**common, max_seg_len=3).tiles_per_prog == 1
    assert choose_expand_config(**common, live_segments=32, segment_programs=32).tiles_per_prog == 1
    # A few-adapter graph's programs take their segments whole unless graph_few_chunk gives them chunks.
    assert choose_expand_config(**common, live_segments=32, segment_programs=32).chunk_tokens == 0
    with launch_shapes_set("graph_few_chunk=64"):
        assert choose_expand_config(**common, live_segments=32, segment_programs=32).chunk_tokens == 64
        assert choose_expand_config(**common).chunk_tokens == 0
    assert choose_expand_config(**{**common, "out_dims": (128, 128, 128), "width": 128}).tiles_per_prog == 1
    # Smaller graphs, where fewer segments are empty, keep one tile a program.
    assert choose_expand_config(**{**common, "num_tokens": 128, "num_segments": 128}).tiles_per_prog == 1
    # The per-token form is unchanged.
    assert choose_expand_config(**{**common, "segmented": False}).tiles_per_prog == 1


def test_an_eager_prefill_launch_walks_two_column_tiles_while_programs_stay_plenty():
    from services.gpu_worker.kernels.lora_expand import choose_expand_config

    # An S2 admission step (8687 tokens over 100 adapters, the longest run 504): 64-token chunks in 16-row
    # tiles (87 tokens a segment), two column tiles a program (4 multiprocessors on the CPU: at least 32
    # programs are left).
    common = dict(num_tokens=8687, num_groups=3, out_dims=(4096, 4096, 4096), width=4096, max_rank=64,
                  device=torch.device("cpu"), segmented=True, num_segments=100, max_seg_len=504)
    prefill = choose_expand_config(**common)
    assert (prefill.tiles_per_prog, prefill.chunk_tokens, prefill.block_m, prefill.block_r) == (2, 64, 16, 16)
    # The same step over 5 adapters (1737 tokens a segment, full chunks): 64-row tiles, 32-row rank steps.
    few = choose_expand_config(**{**common, "num_segments": 5})
    assert (few.tiles_per_prog, few.chunk_tokens, few.block_m, few.block_r) == (2, 64, 64, 32)
    # An eager decode step's short segments keep one tile (slower at 5 adapters when measured) and 32-row
    # rank steps: the 16-row ones were measured on prefill launches only.
    decode = choose_expand_config(**{**common, "max_seg_len": 3})
    assert (decode.tiles_per_prog, decode.block_r) == (1, 32)
    # Segments short on average walk two as well (S2 n = 2000's admission step, 10 tokens a segment over
    # 278 adapters, measured 13-15% faster for q,k,v and gate,up); segments shared out among fewer programs
    # keep one.
    assert choose_expand_config(**{**common, "num_tokens": 300}).tiles_per_prog == 2
    assert choose_expand_config(**common, live_segments=32, segment_programs=32).tiles_per_prog == 1
    # One 100-token prompt on a 256-column output: 2 chunks x 4 two-tile programs would leave the
    # multiprocessors idle.
    small = dict(common, num_tokens=100, num_groups=1, out_dims=(256,), width=256, num_segments=1, max_seg_len=100)
    assert choose_expand_config(**small).tiles_per_prog == 1


def test_a_prefill_of_few_long_segments_keeps_wide_column_tiles():
    from services.gpu_worker.kernels.lora_expand import choose_expand_config

    # Two 1000-token prompts on one 256-column output: 2 segments x 2 tiles would look like too few programs,
    # but the launch has a program per 64-token chunk (32 of them), so tiles stay 128 columns wide.
    common = dict(num_tokens=2000, num_groups=1, out_dims=(256,), width=256, max_rank=64,
                  device=torch.device("cpu"), segmented=True, num_segments=2)
    assert choose_expand_config(**common, max_seg_len=1000).block_n == 128
    # Two 3-token segments (an eager decode step) do have only 2 programs a tile: narrower tiles fill the GPU.
    assert choose_expand_config(**{**common, "num_tokens": 6}, max_seg_len=3).block_n == 32


def long_segment_batch(gen: torch.Generator) -> torch.Tensor:
    """A decode batch whose segments span several 16-row tiles (S-GQA's step over 5 adapters, scaled down):
    base-only tokens, an adapter without some modules (rank 0 there) and a rank-64 one, shuffled."""
    counts = {-1: 5, 0: 37, 1: 20, 2: 19}
    ids = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in counts.items()])
    return ids[torch.randperm(ids.shape[0], generator=gen)].contiguous()


@pytest.mark.parametrize("group", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("programs,live_bound,block_m", [(1, 8, 16), (3, 8, 16), (8, 8, 16), (3, 4, 64),
                                                          (3, 2, 16)])
def test_expand_tiles_dealt_to_the_programs_add_the_same_bits_as_whole_segments(group, programs, live_bound,
                                                                                block_m):
    # Dealt or walked, each output tile is summed by one program over the same rank steps, so the outputs agree
    # bit for bit, and with the reference. A bound below the busy segments (3, 2: four are busy) falls back
    # to the walk on the device.
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=41)
    gen = torch.Generator().manual_seed(42)
    token_adapter = long_segment_batch(gen)
    modules = GROUPS[group]
    # A segment per token, as a decode graph launches them; four of them busy.
    groups = group_tokens_by_adapter(token_adapter, count_live=True)
    kwargs = {**groups.kwargs(), "live_segments": live_bound}
    configs = [ExpandConfig(block_r=16, block_n=16, block_m=block_m, segment_programs=programs, deal_tiles=deal)
               for deal in (False, True)]
    same_bits_under(configs, lp, token_adapter, modules, kwargs, gen)


def test_dealt_tiles_take_whole_segments():
    lp = LoraPool(ALIGNED_CFG, torch.float32, seed=43)
    gen = torch.Generator().manual_seed(44)
    token_adapter = long_segment_batch(gen)
    groups = group_tokens_by_adapter(token_adapter, count_live=True)
    out_dims = tuple(ALIGNED_CFG.module_dims(MODULES[m])[1] for m in GROUPS["down"])
    y = torch.randn(1, token_adapter.shape[0], 16, generator=gen)
    out = torch.zeros(token_adapter.shape[0], sum(out_dims))
    config = ExpandConfig(block_r=16, block_n=16, chunk_tokens=16, segment_programs=2, deal_tiles=True)
    with pytest.raises(ValueError, match="deal_tiles"):
        lora_expand(y, lp.v_buf, token_adapter, lp.tables, GROUPS["down"], out, out_dims, config=config,
                    live_segments=8, **groups.kwargs())


def test_a_few_adapter_graph_deals_its_expand_tiles_when_asked():
    from services.gpu_worker.kernels.lora_expand import choose_expand_config

    common = dict(num_tokens=512, num_groups=3, out_dims=(4096, 1024, 1024), width=4096, max_rank=64,
                  device=torch.device("cpu"), segmented=True, num_segments=512)
    few = dict(live_segments=32, segment_programs=32)
    assert not choose_expand_config(**common, **few).deal_tiles
    with launch_shapes_set("graph_few_expand_deal"):
        assert choose_expand_config(**common, **few).deal_tiles
        # Graphs planned for every segment and eager launches walk as before.
        assert not choose_expand_config(**common).deal_tiles
        assert not choose_expand_config(**common, max_seg_len=3).deal_tiles
    # Dealing's vectors hold at most graph_few_deal_max (8) busy segments: a step with more walks on the device.
    from services.gpu_worker.kernels.lora_rows import deal_constexprs, segment_form

    groups = group_tokens_by_adapter((torch.arange(512, dtype=torch.int32) * 7) % 32, count_live=True)
    hints = groups.kwargs()
    for words, block in (("graph_few_expand_deal", 8), ("graph_few_expand_deal,graph_few_deal_max=4", 4),
                         ("graph_few_expand_deal,no_graph_few_deal_max", 32)):
        with launch_shapes_set(words):
            cfg = choose_expand_config(**common, **few)
            form = segment_form(cfg, 512, None, hints["seg_start"], hints["seg_adapter"], hints["token_order"],
                                hints["num_live"], None, torch.float32, torch.device("cpu"))
            assert deal_constexprs(cfg, form, 32, 512) == {"DEAL": True, "SEG_BLOCK": block}
    # Dealing takes whole segments: it overrides graph_few_chunk.
    with launch_shapes_set("graph_few_expand_deal,graph_few_chunk=64"):
        cfg = choose_expand_config(**common, **few)
        assert cfg.deal_tiles and cfg.chunk_tokens == 0
