"""A decode graph's stacked LoRA: the stacks' buffers for a step's few adapters, and the model's LoRA through
them against the segment ops (CPU, reference backend; the graphs themselves: tests/gpu_worker/test_cuda_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.graph_stacks import GraphStacks, stacked_columns
from services.gpu_worker.model import DOWN, GATE_UP, O, QKV
from services.gpu_worker.ops.meta import LoraBatch
from shared.config import EngineConfig
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import ModelConfig
from shared.tiny_model import VOCAB_SIZE, hf_config

GROUPS = (QKV, O, GATE_UP, DOWN)


def adapter(name: str, cfg: ModelConfig, ranks: dict[str, int], seed: int) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for m, r in ranks.items():
        fan_in, fan_out = cfg.module_dims(m)
        modules[m] = [LoraModuleWeights(torch.randn(r, fan_in, generator=gen) / fan_in ** 0.5,
                                        torch.randn(fan_out, r, generator=gen), scale=0.5)
                      for _ in range(cfg.num_layers)]
    return LoraWeights(name, cfg.num_layers, modules)


@pytest.fixture
def engine_with_residents():
    cfg = ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE))
    engine = Engine.with_dummy_weights(cfg, EngineConfig(device="cpu", dtype="float32", num_slots=4096,
                                                         max_lora_rank=32, max_resident_adapters=6))
    ranks = {"attn": {"q_proj": 4, "v_proj": 4, "o_proj": 4}, "mlp": {"k_proj": 32, "gate_proj": 32, "down_proj": 32},
             "all": {m: 8 for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}}
    residents = {}
    for seed, (name, r) in enumerate(ranks.items()):
        engine.register_adapter(name, adapter(name, cfg, r, seed))
        residents[name] = engine.adapters.acquire(name)
    zero = engine.pool.allocator.allocate(1)[0]
    engine.pool.kv[:, :, zero] = 0
    stacks = GraphStacks(cfg, GROUPS, engine.pool.slot_width, zero, engine.adapters.tables.ranks.shape[0], "cpu")
    return engine, residents, stacks


def test_columns_are_the_widest_ranks_summed_in_powers_of_two_from_64():
    assert [stacked_columns(w) for w in ([], [8, 16], [64], [64, 8], [32] * 4, [64] * 5)] == [64, 64, 64, 128, 128, 512]


def test_the_models_lora_through_the_stacks_equals_the_segment_ops(engine_with_residents):
    engine, residents, stacks = engine_with_residents
    model, cfg = engine.model, engine.cfg
    step = [residents["mlp"], residents["attn"]]  # "all" is resident but not in this step
    columns = stacked_columns([max(r.ranks) for r in step])
    stacks.fill(columns, step)
    ids = [residents["attn"].resident_id, -1, residents["mlp"].resident_id, residents["attn"].resident_id, -1,
           residents["mlp"].resident_id]
    token_adapter = torch.tensor(ids, dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    for layer in range(cfg.num_layers):
        for modules, dims in zip(GROUPS, ((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), (cfg.hidden_size,),
                                          (cfg.intermediate_size,) * 2, (cfg.hidden_size,))):
            fan_in = cfg.module_dims(("q_proj", "o_proj", "gate_proj", "down_proj")[GROUPS.index(modules)])[0]
            x = torch.randn(len(ids), fan_in, generator=gen)
            base = torch.randn(len(ids), sum(dims), generator=gen)
            outs = []
            for stacked in (False, True):
                lora = LoraBatch(tables=engine.adapters.tables, token_adapter=token_adapter, max_rank=(32,) * 7)
                if stacked:
                    lora.stacks, lora.stack_columns = stacks, columns
                model.prepare_lora(lora)  # as forward does, once a step
                out = base.clone()
                model._lora(x, out, lora, engine.pool, layer, modules, dims)
                outs.append(out)
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
            assert (outs[1] - base)[token_adapter < 0].abs().max() == 0


def test_a_fill_is_skipped_while_the_step_keeps_its_adapters(engine_with_residents):
    _, residents, stacks = engine_with_residents
    first = [residents["attn"], residents["all"]]
    stacks.fill(64, first)
    stacks.fill(64, first)
    assert stacks.fills == 1
    assert stacks.positions(torch.tensor([residents["all"].resident_id, -1, residents["mlp"].resident_id,
                                          residents["attn"].resident_id])).tolist() == [1, -1, -1, 0]
    # Another mix refills the buffers and the lookup; back to the first, its buffers still hold it: the lookup
    # alone is refilled.
    stacks.fill(64, [residents["mlp"]])
    assert stacks.fills == 2 and stacks.positions(torch.tensor([residents["mlp"].resident_id])).tolist() == [0]
    stacks.fill(128, first)
    stacks.fill(64, first)
    assert stacks.fills == 4 and stacks.positions(torch.tensor([residents["attn"].resident_id])).tolist() == [0]
    # Each adapter takes its widest rank's columns in every group, even one it does not adapt: 4 for "attn", 8
    # for "all"; the rest of the 64 none.
    for modules in GROUPS:
        assert stacks.rows(64)[modules].owner.tolist() == [0] * 4 + [1] * 8 + [-1] * 52
