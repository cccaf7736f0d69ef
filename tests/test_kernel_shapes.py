"""worker.kernel_shapes: the launch shapes a worker tries in place of the kernels' own choice, read from words and
refused by name when a word is wrong; the launchers choose them once set."""
from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig
from shared.kernel_shapes import LaunchShapes


def test_words_set_the_shapes_they_name():
    assert LaunchShapes.parse("") == LaunchShapes()
    assert LaunchShapes.parse("attention_block_n=64, heads_first,attention_stages=4") == \
        LaunchShapes(attention_block_n=64, attention_stages=4, heads_first=True)
    assert LaunchShapes.parse("split_mixed,expand_cols_first") == LaunchShapes(split_mixed=True,
                                                                               expand_cols_first=True)
    # heads_first and split_mixed are on by default: the words themselves show after a no_ word (the last wins).
    assert LaunchShapes.parse("no_heads_first,heads_first").heads_first
    assert LaunchShapes.parse("no_split_mixed,split_mixed").split_mixed
    assert LaunchShapes.parse("graph_few_expand_deal").graph_few_expand_deal
    assert not LaunchShapes().graph_few_expand_deal
    assert LaunchShapes.parse("graph_few_shrink_deal").graph_few_shrink_deal
    assert not LaunchShapes().graph_few_shrink_deal


def test_the_shapes_the_h200_favoured_are_on_by_default_and_no_words_turn_them_off():
    assert LaunchShapes() == LaunchShapes.parse("heads_first,split_mixed")
    assert LaunchShapes().heads_first and LaunchShapes().split_mixed and not LaunchShapes().expand_cols_first
    off = LaunchShapes.parse("no_heads_first, no_split_mixed")
    assert not off.heads_first and not off.split_mixed and off == LaunchShapes(heads_first=False, split_mixed=False)
    assert LaunchShapes.parse("no_expand_cols_first,expand_cols_first").expand_cols_first


def test_the_few_adapter_shrink_picks_its_tile_height_per_segment_by_default_and_no_word_keeps_one():
    assert LaunchShapes().graph_few_shrink_long == 16
    assert LaunchShapes.parse("no_graph_few_shrink_long").graph_few_shrink_long == 0
    assert LaunchShapes.parse("no_graph_few_shrink_long,graph_few_shrink_long=32").graph_few_shrink_long == 32


def test_the_expand_register_cap_is_on_by_default_at_any_count_ptxas_takes():
    assert LaunchShapes().expand_registers == 56
    assert LaunchShapes.parse("expand_registers=40").expand_registers == 40  # not a power of two
    assert LaunchShapes.parse("no_expand_registers").expand_registers == 0


def test_the_register_cap_goes_to_the_many_program_expand_launches_only():
    from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
    from services.gpu_worker.kernels.lora_expand import choose_expand_config

    cpu, dims = torch.device("cpu"), (4096, 1024, 1024)

    def caps():
        graph = choose_expand_config(384, 3, dims, 4096, 64, cpu, True, None, 384)  # a segment per token
        few = choose_expand_config(384, 3, dims, 4096, 64, cpu, True, None, 384, 32, 32)  # shared out
        # An admission step of short segments (16-row tiles) and a prefill of a few long ones (64-row tiles).
        short = choose_expand_config(2926, 3, dims, 4096, 64, cpu, True, 500, 288)
        long = choose_expand_config(8000, 3, dims, 4096, 64, cpu, True, 2000, 5)
        assert (short.block_m, long.block_m) == (16, 64)
        return graph.max_registers, few.max_registers, short.max_registers, long.max_registers

    assert caps() == (56, 0, 56, 0)
    try:
        set_launch_shapes(LaunchShapes.parse("expand_registers=64"))
        assert caps() == (64, 0, 64, 0)
        set_launch_shapes(LaunchShapes.parse("no_expand_registers"))
        assert caps() == (0, 0, 0, 0)
    finally:
        set_launch_shapes(LaunchShapes())


@pytest.mark.parametrize("text, message", [
    ("heads_last", "unknown word 'heads_last'"),
    ("attention_block_n=48", "attention_block_n needs a power of two"),
    ("attention_block_n", "attention_block_n needs a power of two"),
    ("attention_stages=0", "attention_stages needs a power of two"),
    ("attention_warps=3", "attention_warps needs a power of two"),
    ("attention_block_n=8", "attention_block_n must be at least 16"),
    ("graph_few_shrink_m=8", "graph_few_shrink_m must be 16 to 128"),
    ("graph_few_shrink_m=256", "graph_few_shrink_m must be 16 to 128"),
    ("graph_few_shrink_m=48", "graph_few_shrink_m needs a power of two"),
    ("graph_few_shrink_long=24", "graph_few_shrink_long needs a power of two"),
    ("split_mixed=yes", "split_mixed takes no value"),
    ("no_split_mixed=yes", "split_mixed takes no value"),
    ("no_attention_block_n=64", "unknown word 'no_attention_block_n'"),
    ("no_attention_block_n", "unknown word 'no_attention_block_n'"),  # a number off by default has no no_ word
    ("no_graph_few_shrink_long=16", "graph_few_shrink_long takes no value"),
    ("expand_registers=16", "expand_registers needs a register count from 24 to 255"),
    ("expand_registers=256", "expand_registers needs a register count from 24 to 255"),
    ("expand_registers", "expand_registers needs a register count"),
    ("no_expand_registers=56", "expand_registers takes no value"),
    ("graph_batch_step=128", "graph_batch_step must be 8 to 64 rows"),
    ("graph_batch_step=4", "graph_batch_step must be 8 to 64 rows"),
    ("no_graph_batch_step", "graph_batch_step must be 8 to 64 rows"),
    ("graph_batch_step=48", "graph_batch_step needs a power of two"),
])
def test_a_wrong_word_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        LaunchShapes.parse(text)
    # The engine's config refuses it too, before any worker starts.
    with pytest.raises(ValueError, match="kernel_shapes"):
        EngineConfig(kernel_shapes=text)


def test_the_worker_command_line_refuses_a_wrong_word(tmp_path, capsys):
    from services.gpu_worker.worker_config import parse_args

    _, engine = parse_args(["--model", str(tmp_path), "--kernel-shapes", "heads_first,split_mixed"])
    assert engine.kernel_shapes == "heads_first,split_mixed"
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path), "--kernel-shapes", "heads_sideways"])
    assert "unknown word 'heads_sideways'" in capsys.readouterr().err


def test_the_launchers_choose_the_shapes_set_and_their_own_again_after():
    from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
    from services.gpu_worker.kernels.lora_expand import choose_expand_config
    from services.gpu_worker.kernels.paged_attention import choose_attention_config
    from services.gpu_worker.ops.meta import AttnMeta

    def meta(q_lens):
        n = len(q_lens)
        return AttnMeta(q_start=torch.zeros(n + 1, dtype=torch.int32), ctx_lens=torch.zeros(n, dtype=torch.int32),
                        slot_table=torch.zeros(n, 600, dtype=torch.int32), max_q_len=max(q_lens), max_ctx_len=600,
                        decode_only=max(q_lens) == 1)

    cpu = torch.device("cpu")

    def chosen():
        decode = choose_attention_config(meta([1] * 8), 8, 4, 128, cpu)
        prefill = choose_attention_config(meta([1, 300]), 8, 4, 128, cpu)
        expand = choose_expand_config(256, 3, (4096, 1024, 1024), 4096, 64, cpu, True)
        return decode, prefill, expand

    own = chosen()
    # Heads first is the default order (kernel_shapes' heads_first is on unless no_heads_first).
    assert (own[0].block_n, own[0].num_stages, own[0].heads_first, own[2].cols_first) == (128, 3, True, False)
    assert own[1].heads_first
    try:
        set_launch_shapes(LaunchShapes.parse("attention_block_n=64,attention_stages=4,attention_warps=2,"
                                             "no_heads_first,expand_cols_first"))
        decode, prefill, expand = chosen()
        assert (decode.block_n, decode.num_stages, decode.num_warps, decode.heads_first) == (64, 4, 2, False)
        # A prompt's blocks are its own choice; its program order follows heads_first.
        assert (prefill.block_n, prefill.num_stages, prefill.num_warps, prefill.heads_first) == \
            (own[1].block_n, own[1].num_stages, own[1].num_warps, False)
        assert expand.cols_first and expand.block_n == own[2].block_n
    finally:
        set_launch_shapes(LaunchShapes())
    assert chosen() == own


def test_the_stacked_plan_takes_any_count_of_adapters_and_is_on_by_default_held():
    assert (LaunchShapes().graph_few_stacked, LaunchShapes().graph_stacked_held) == (8, 256)
    assert LaunchShapes.parse("no_graph_few_stacked").graph_few_stacked == 0
    assert LaunchShapes.parse("no_graph_stacked_held").graph_stacked_held == 0
    for bad in ("graph_stacked_held=32", "graph_stacked_held=200"):
        with pytest.raises(ValueError, match="graph_stacked_held"):
            LaunchShapes.parse(bad)
    assert LaunchShapes.parse("graph_few_stacked=5").graph_few_stacked == 5  # not only powers of two
    for bad in ("graph_few_stacked", "graph_few_stacked=0", "graph_few_stacked=x"):
        with pytest.raises(ValueError, match="graph_few_stacked needs a count of adapters"):
            LaunchShapes.parse(bad)


def test_the_graphs_batch_step_past_256_is_64_rows_by_default():
    assert LaunchShapes().graph_batch_step == 64
    assert LaunchShapes.parse("graph_batch_step=32").graph_batch_step == 32
