"""Which decode graphs a worker captures before it reports ready, and in what order (the capture itself
needs a GPU: tests/gpu_worker/test_cuda_graphs.py)."""
import pytest

from services.gpu_worker.cuda_graphs import (ALL_GROUPS, NO_GROUPS, StackPlan, busy_segments, capture_plan,
                                             group_ranks, groups_of_modules, lora_groups, lora_plans, stacked_plan,
                                             step_ranks, step_residents)
from services.gpu_worker.resident_adapters import Resident
from shared.config import EngineConfig


def test_plan_covers_every_key_once_short_contexts_first_large_batches_first():
    plan = capture_plan((1, 2, 4), (16, 32), (512, 1024))
    assert len(plan) == len(set(plan)) == 3 * 3 * 2
    assert {ctx for _, _, ctx, _, _ in plan[:9]} == {512}  # every graph of the shortest contexts comes first
    assert [size for size, _, _, _, _ in plan[:9]] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert [rank for _, rank, _, _, _ in plan[:3]] == [0, 16, 32]
    assert not any(few for _, _, _, few, _ in plan), "no few-adapter graphs unless asked for"
    # Warm-up's LoRA graphs run every module group, so they compile every kernel a narrower graph needs.
    assert all(groups == (ALL_GROUPS if rank else NO_GROUPS) for _, rank, _, _, groups in plan)


def test_few_adapter_graphs_are_captured_beside_the_others_where_a_bucket_can_exceed_them():
    plan = capture_plan((1, 2, 4, 8), (16,), (512,), few_adapters=2)
    assert lora_plans(2, 2) == (True,) and lora_plans(4, 2) == (True, False) and lora_plans(4, 0) == (False,)
    # Base-only graphs run no LoRA kernels: one plan. Buckets of <= 2 requests carry <= 2 segments.
    assert [key[:4] for key in plan] == [(8, 0, 512, False), (8, 16, 512, True), (8, 16, 512, False),
                                         (4, 0, 512, False), (4, 16, 512, True), (4, 16, 512, False),
                                         (2, 0, 512, False), (2, 16, 512, True), (1, 0, 512, False),
                                         (1, 16, 512, True)]


@pytest.mark.parametrize("ids,size,busy", [
    ([3, 3, 5], 4, 3),          # two adapters and the padding row
    ([3, 3, 5, 5], 4, 2),       # no base-model row at all
    ([None, 3, None, 7], 4, 3),  # base-model requests count once
    ([None], 1, 1),
    (list(range(256)), 256, 256),
])
def test_busy_segments_count_each_adapter_and_the_base_model_once(ids, size, busy):
    assert busy_segments(ids, size) == busy


@pytest.mark.parametrize("field,value", [("cuda_graph_warmup_s", -1.0), ("cuda_graph_max_context", -5),
                                         ("cuda_graph_few_adapters", -1), ("cuda_graph_few_adapters", 2.5),
                                         ("cuda_graph_segment_programs", -4)])
def test_graph_warm_up_settings_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_few_adapter_graphs_need_programs_to_share_their_segments():
    with pytest.raises(ValueError, match="cuda_graph_segment_programs"):
        EngineConfig(cuda_graph_few_adapters=32, cuda_graph_segment_programs=0)
    assert EngineConfig(cuda_graph_few_adapters=0, cuda_graph_segment_programs=0).cuda_graph_few_adapters == 0


def test_a_step_runs_the_lora_groups_its_adapters_adapt():
    qkvo = (8, 8, 8, 8, 0, 0, 0)  # S1/S2 adapters: attention only
    mlp_down = (0, 0, 0, 0, 0, 0, 16)
    assert step_ranks([]) == (0,) * 7
    assert step_ranks([qkvo, mlp_down, (4, 0, 32, 0, 0, 0, 0)]) == (8, 8, 32, 8, 0, 0, 16)
    assert lora_groups(step_ranks([qkvo])) == (True, True, False, False)  # q,k,v and o; no gate,up or down
    assert lora_groups((0, 0, 4, 0, 0, 0, 0)) == (True, False, False, False)  # v alone runs the q,k,v group
    assert lora_groups(step_ranks([qkvo, mlp_down])) == (True, True, False, True)
    assert lora_groups((1,) * 7) == ALL_GROUPS and lora_groups((0,) * 7) == NO_GROUPS
    # A graph's per-module ranks: its bucket on the modules of its groups, 0 (not launched) elsewhere.
    assert group_ranks(64, (True, True, False, False)) == (64, 64, 64, 64, 0, 0, 0)
    assert group_ranks(16, (False, False, True, True)) == (0, 0, 0, 0, 16, 16, 16)
    assert lora_groups(group_ranks(16, (True, False, False, True))) == (True, False, False, True)


def test_warm_up_captures_the_groups_of_the_modules_served_adapters_adapt():
    attention = EngineConfig(cuda_graph_lora_targets="q_proj, k_proj,v_proj,o_proj").graph_lora_targets()
    assert attention == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert groups_of_modules(attention) == (True, True, False, False)
    assert groups_of_modules(("q_proj", "v_proj")) == (True, False, False, False)  # PEFT's default targets
    assert groups_of_modules(EngineConfig().graph_lora_targets()) == ALL_GROUPS  # unset: every module
    plan = capture_plan((1, 2), (16,), (512,), groups=(True, True, False, False))
    assert plan == [(2, 0, 512, False, NO_GROUPS), (2, 16, 512, False, (True, True, False, False)),
                    (1, 0, 512, False, NO_GROUPS), (1, 16, 512, False, (True, True, False, False))]


@pytest.mark.parametrize("value", ["q_proj,lm_head", "qproj", 7])
def test_graph_lora_targets_name_adaptable_modules(value):
    with pytest.raises(ValueError, match="cuda_graph_lora_targets"):
        EngineConfig(cuda_graph_lora_targets=value)


class _Seq:
    def __init__(self, adapter):
        self.adapter = adapter


def test_a_step_of_few_adapters_replays_the_stacked_graph_of_their_widest_ranks_summed():
    a, b, c = (Resident(n, i, [], ranks) for i, (n, ranks) in enumerate(
        [("a", (8, 8, 8, 8, 0, 0, 0)), ("b", (0, 64, 0, 0, 16, 16, 16)), ("c", (4,) * 7)]))
    # Requests name adapters in any order and more than once; base-model requests name none. The stack takes
    # them by resident id, so another order of the same requests keeps its layout.
    residents = step_residents([_Seq(b), _Seq(None), _Seq(a), _Seq(b), _Seq(c)])
    assert [r.name for r in residents] == ["a", "b", "c"]
    assert step_residents([_Seq(c), _Seq(a), _Seq(b)]) == residents
    assert stacked_plan(residents, 4) == StackPlan(128, False)  # 64 + 8 + 4 columns, in a power of two from 64
    assert stacked_plan(residents[::2], 4) == StackPlan(64, False)
    # Held: as wide as the held buffers allow, and a wider stack takes the segment launches.
    assert stacked_plan(residents, 4, held=128) == StackPlan(128, True)
    assert stacked_plan(residents, 4, held=64) is None
    assert stacked_plan(residents[::2], 4, held=64) == StackPlan(64, True)
    # Off, more adapters than the word allows, or a base-model step: the segment launches.
    assert stacked_plan(residents, 0) is stacked_plan(residents, 2) is stacked_plan([], 4) is None
