"""A decode graph's stacked LoRA: the stacks' buffers for a step's few adapters, and the model's LoRA through
them against the segment ops (CPU, reference backend; the graphs themselves: tests/gpu_worker/test_cuda_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.graph_stacks import GraphStacks, stacked_columns
from services.gpu_worker.held_stacks import HeldStacks, held_bytes
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
    # Held buffers of 64 columns (graph_stacked_held=64), float32 as the pool.
    held = HeldStacks(cfg, GROUPS, engine.pool.slot_width, 64, engine.pool.dtype, "cpu")
    stacks = GraphStacks(cfg, GROUPS, engine.pool.slot_width, zero, engine.adapters.tables.ranks.shape[0], "cpu",
                         held=held)
    return engine, residents, stacks


def group_inputs(cfg: ModelConfig, tokens: int, seed: int):
    """(layer, modules, out_dims, x, base output) for every layer and LoRA group: random inputs of `tokens` rows."""
    gen = torch.Generator().manual_seed(seed)
    fan_in_of = ("q_proj", "o_proj", "gate_proj", "down_proj")
    out_dims = ((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), (cfg.hidden_size,), (cfg.intermediate_size,) * 2,
                (cfg.hidden_size,))
    for layer in range(cfg.num_layers):
        for modules, dims, module in zip(GROUPS, out_dims, fan_in_of):
            x = torch.randn(tokens, cfg.module_dims(module)[0], generator=gen)
            yield layer, modules, dims, x, torch.randn(tokens, sum(dims), generator=gen)


def test_columns_are_the_widest_ranks_summed_in_powers_of_two_from_64():
    assert [stacked_columns(w) for w in ([], [8, 16], [64], [64, 8], [32] * 4, [64] * 5)] == [64, 64, 64, 128, 128, 512]


def test_the_models_lora_through_the_stacks_equals_the_segment_ops(engine_with_residents):
    engine, residents, stacks = engine_with_residents
    model, cfg = engine.model, engine.cfg
    step = [residents["mlp"], residents["attn"]]  # "all" is resident but not in this step
    columns = stacked_columns([max(r.ranks) for r in step])
    stacks.fill(columns, step, engine.pool, held=True)
    ids = [residents["attn"].resident_id, -1, residents["mlp"].resident_id, residents["attn"].resident_id, -1,
           residents["mlp"].resident_id]
    token_adapter = torch.tensor(ids, dtype=torch.int32)
    for layer, modules, dims, x, base in group_inputs(cfg, len(ids), seed=7):
        outs = []
        for stacked, held in ((False, False), (True, False), (True, True)):
            lora = LoraBatch(tables=engine.adapters.tables, token_adapter=token_adapter, max_rank=(32,) * 7)
            if stacked:
                lora.stacks, lora.stack_columns, lora.stack_held = stacks, columns, held
            model.prepare_lora(lora)  # as forward does, once a step
            out = base.clone()
            model._lora(x, out, lora, engine.pool, layer, modules, dims)
            outs.append(out)
        # Gathered now or held since the fill, the same rows: the same sums, bit for bit.
        assert torch.equal(outs[2], outs[1])
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


def held_operands(stacks: GraphStacks, pool, columns: int) -> list[torch.Tensor]:
    """Every layer's and group's operands as the held buffers give them, copied."""
    out = []
    for layer in range(pool.kv.shape[0]):
        for modules in GROUPS:
            a, bts = stacks.operands(pool, layer, modules, columns, held=True)
            out += [a.clone()] + [bt.clone() for bt in bts]
    return out


def test_held_stacks_are_gathered_when_the_adapters_change_and_not_while_they_stay(engine_with_residents):
    engine, residents, stacks = engine_with_residents
    held, pool = stacks.held_stacks, engine.pool
    first = [residents["attn"], residents["all"]]
    stacks.fill(64, first, pool, held=True)
    stacks.fill(64, first, pool, held=True)
    assert held.gathers == 1
    before = held_operands(stacks, pool, 64)
    # The same adapters at the same columns, gathered every step, read what the buffers hold.
    for layer in range(pool.kv.shape[0]):
        for modules in GROUPS:
            a, bts = stacks.operands(pool, layer, modules, 64, held=False)
            h_a, h_bts = stacks.operands(pool, layer, modules, 64, held=True)
            assert torch.equal(a, h_a) and all(torch.equal(x, y) for x, y in zip(bts, h_bts))
    # Another mix gathers anew; the segment ops' fill (held=False) leaves the held buffers alone.
    stacks.fill(64, [residents["mlp"]], pool, held=False)
    assert held.gathers == 1
    stacks.fill(64, [residents["mlp"]], pool, held=True)
    assert held.gathers == 2 and stacks.gathered[0] == 64
    stacks.fill(64, first, pool, held=True)
    assert held.gathers == 3
    assert all(torch.equal(x, y) for x, y in zip(held_operands(stacks, pool, 64), before))
    # A stack wider than the held buffers is refused, naming the word that would take it.
    with pytest.raises(ValueError, match="graph_stacked_held=128"):
        stacks.fill(128, first, pool, held=True)
    assert held.gathers == 3


def test_an_adapter_loaded_again_is_gathered_again(engine_with_residents):
    # Unloaded and registered again under its name with other weights, an adapter comes back under the same
    # resident id; it is a new Resident, and the held buffers must not go on serving the old rows.
    engine, residents, stacks = engine_with_residents
    held, pool = stacks.held_stacks, engine.pool
    old = residents["attn"]
    stacks.fill(64, [old], pool, held=True)
    before, _ = stacks.operands(pool, 0, QKV, 64, held=True)
    before = before.clone()
    engine.adapters.release("attn")
    assert engine.adapters.evict("attn")
    engine.register_adapter("attn", adapter("attn", engine.cfg, {"q_proj": 4, "v_proj": 4, "o_proj": 4}, 9))
    again = engine.adapters.acquire("attn")
    assert again is not old and again.resident_id == old.resident_id
    stacks.fill(64, [again], pool, held=True)
    assert held.gathers == 2
    a, _ = stacks.operands(pool, 0, QKV, 64, held=True)
    fresh, _ = stacks.operands(pool, 0, QKV, 64, held=False)
    assert torch.equal(a, fresh) and not torch.equal(a, before)


def test_the_held_buffers_take_what_held_bytes_says(engine_with_residents):
    # held_bytes against the stacks' own index lists (ops.stacked_lora.stack_rows): a buffer row for every
    # row a full-width stack gathers, in every layer.
    engine, _, stacks = engine_with_residents
    held, cfg = stacks.held_stacks, engine.cfg
    taken = sum(t.numel() * t.element_size() for t in (*held.a.values(), *held.b.values()))
    gathered_rows = sum(r.a_rows.numel() + r.b_rows.numel() for r in stacks.rows(held.columns).values())
    row_bytes = engine.pool.slot_width * engine.pool.kv.element_size()
    assert taken == held_bytes(cfg, GROUPS, engine.pool.slot_width, held.columns, engine.pool.dtype) \
        == cfg.num_layers * gathered_rows * row_bytes > 0
    # Twice the columns, twice the bytes: every row is a column's.
    assert held_bytes(cfg, GROUPS, engine.pool.slot_width, 128, engine.pool.dtype) == 2 * taken


def test_a_held_gather_copies_only_the_groups_its_adapters_adapt(engine_with_residents):
    engine, residents, stacks = engine_with_residents
    held, pool = stacks.held_stacks, engine.pool
    # "attn" adapts q, v and o: the q,k,v and o groups; the MLP's buffers are not written (still zeros).
    stacks.fill(64, [residents["attn"]], pool, held=True)
    assert all(held.a[m].abs().sum() == 0 and held.b[m].abs().sum() == 0 for m in (GATE_UP, DOWN))
    for layer in range(pool.kv.shape[0]):
        for modules in (QKV, O):
            a, bts = stacks.operands(pool, layer, modules, 64, held=True)
            g_a, g_bts = stacks.operands(pool, layer, modules, 64, held=False)
            assert torch.equal(a, g_a) and all(torch.equal(x, y) for x, y in zip(bts, g_bts))
    # "mlp" adapts k, gate and down: q,k,v, gate,up and down are gathered, and read as the pool gives them.
    stacks.fill(64, [residents["mlp"]], pool, held=True)
    for modules in (QKV, GATE_UP, DOWN):
        a, bts = stacks.operands(pool, 1, modules, 64, held=True)
        g_a, g_bts = stacks.operands(pool, 1, modules, 64, held=False)
        assert torch.equal(a, g_a) and all(torch.equal(x, y) for x, y in zip(bts, g_bts))
    assert held.a[GATE_UP].abs().sum() > 0
