"""Grouping a step's tokens by adapter on the device (segment form at decode)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels import group_tokens_by_adapter


def segments(groups):
    starts = groups.seg_start.tolist()
    return [(groups.seg_adapter[s].item(), starts[s], starts[s + 1]) for s in range(len(starts) - 1)]


def test_groups_cover_every_token_once_with_one_adapter_per_segment():
    gen = torch.Generator().manual_seed(0)
    token_adapter = torch.randint(-1, 9, (57,), generator=gen, dtype=torch.int32)
    groups = group_tokens_by_adapter(token_adapter, max_adapters=9)
    order = groups.token_order.long()
    assert sorted(order.tolist()) == list(range(57))
    assert groups.seg_adapter.shape[0] == 10 and groups.seg_start.shape[0] == 11
    seen = []
    prev_end = 0
    for adapter, start, end in segments(groups):
        assert start == prev_end, "segments must tile the sorted positions"
        prev_end = end
        if end > start:
            members = token_adapter[order[start:end]]
            assert torch.all(members == adapter)
            seen.append(adapter)
        else:
            assert adapter == -1, "empty segments carry no adapter"
    assert prev_end == 57
    assert seen == sorted(set(token_adapter.tolist())), "one segment per distinct adapter, in order"
    # Stable: tokens of one adapter keep their batch order.
    for adapter, start, end in segments(groups):
        assert order[start:end].tolist() == sorted(order[start:end].tolist())


def test_groups_without_bound_use_one_segment_slot_per_token():
    token_adapter = torch.tensor([3, 3, -1, 0], dtype=torch.int32)
    groups = group_tokens_by_adapter(token_adapter)
    assert segments(groups) == [(-1, 0, 1), (0, 1, 2), (3, 2, 4), (-1, 4, 4)]
    assert groups.token_order.tolist() == [2, 3, 0, 1]


def test_an_exact_distinct_count_launches_only_the_segments_in_use():
    # A prefill step of 5 adapters and base-only tokens: 6 segments, not one per resident table row.
    gen = torch.Generator().manual_seed(1)
    token_adapter = torch.randint(-1, 5, (300,), generator=gen, dtype=torch.int32)
    distinct = len(set(token_adapter.tolist()))
    bounded = group_tokens_by_adapter(token_adapter, max_adapters=4096)
    exact = group_tokens_by_adapter(token_adapter, max_adapters=4096, num_distinct=distinct)
    assert bounded.seg_adapter.shape[0] == 300 and exact.seg_adapter.shape[0] == distinct == 6
    assert torch.equal(exact.token_order, bounded.token_order)
    assert segments(exact) == [s for s in segments(bounded) if s[2] > s[1]], "the same runs, none empty"


@pytest.mark.parametrize("live,programs", [(None, 0), (32, 32), (16, 0)])
def test_a_graph_step_launches_a_segment_per_token_under_its_plan(live, programs):
    from services.gpu_worker.ops.meta import LoraBatch, LoraTables
    from services.gpu_worker.ops.triton_backend import prepare_lora

    rows = torch.zeros(4096, 7, dtype=torch.int32)
    tables = LoraTables(slots=torch.zeros(4096, 8, dtype=torch.int32), ranks=rows, a_off=rows, b_off=rows)
    token_adapter = torch.tensor([3, 3, -1, 0] * 64, dtype=torch.int32)
    graph = LoraBatch(tables=tables, token_adapter=token_adapter, max_rank=(64,) * 7,  # as a decode graph builds it
                      live_segments=live, segment_programs=programs)
    prepare_lora(graph)
    assert graph.kernel_args["seg_adapter"].shape[0] == 256  # one segment per token
    assert graph.kernel_args["live_segments"] == live
    # The count of segments in use is made only when the graph's launches share segments out.
    assert graph.kernel_args["segment_programs"] == programs
    assert ("num_live" in graph.kernel_args) == (programs > 0)
    if programs:
        assert graph.kernel_args["num_live"].tolist() == [3]
    eager = LoraBatch(tables=tables, token_adapter=token_adapter, max_rank=(64,) * 7, segment_lengths=(128, 64, 64),
                      live_segments=live, segment_programs=programs)
    prepare_lora(eager)  # the host knows the step's segments: the graph plan does not apply
    assert eager.kernel_args["seg_adapter"].shape[0] == 3 and eager.kernel_args["live_segments"] is None
    assert eager.kernel_args["segment_programs"] == 0 and "num_live" not in eager.kernel_args


def test_the_count_of_segments_in_use_is_left_on_the_device():
    token_adapter = torch.tensor([3, 3, -1, 0, 7, 3], dtype=torch.int32)
    groups = group_tokens_by_adapter(token_adapter, max_adapters=4096, count_live=True)
    assert groups.seg_adapter.shape[0] == 6 and groups.num_live.tolist() == [4]
    assert groups.kwargs()["num_live"] is groups.num_live
    assert [a for a, lo, hi in segments(groups)[:4]] == [-1, 0, 3, 7]
    assert all(hi == lo for _, lo, hi in segments(groups)[4:])  # past num_live: empty
    assert group_tokens_by_adapter(token_adapter[:0], count_live=True).num_live.tolist() == [0]
    # Not asked for, not computed: a step whose launches do not share segments out pays nothing for it.
    plain = group_tokens_by_adapter(token_adapter, max_adapters=4096)
    assert plain.num_live is None and "num_live" not in plain.kwargs()
