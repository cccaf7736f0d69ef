"""Warm-up covers the shapes traffic compiles kernels for: each warm-up adapter alone (rank 8, and a wide one
when ranks above 16 are accepted: the LoRA kernels tile those otherwise), all mixed, and one admission round
as large as a step takes, alone and beside a busy batch's decodes; afterwards the pool holds nothing of it."""
from __future__ import annotations

import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.warmup import (
    WARMUP_ADAPTER, WIDE_ADAPTER, WithWarmupAdapter, warm_up, warmup_round, warmup_adapters, warmup_ranks,
)
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import VOCAB_SIZE, hf_config


def test_a_wide_adapter_joins_when_ranks_above_16_are_accepted():
    assert warmup_ranks(256) == {WARMUP_ADAPTER: 8, WIDE_ADAPTER: 64}
    assert warmup_ranks(32) == {WARMUP_ADAPTER: 8, WIDE_ADAPTER: 32}
    assert warmup_ranks(16) == {WARMUP_ADAPTER: 8}
    assert warmup_ranks(4) == {WARMUP_ADAPTER: 4}


def test_the_admission_round_fills_a_step_within_a_quarter_of_the_pool():
    cfg = ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE))
    round_ = warmup_round(cfg, max_model_len=2048, num_slots=100_000, requests=32, tokens=8192, adapters=["x", "y"])
    assert len(round_) == 32 and {len(r.prompt_ids) for r in round_} == {256}
    assert sum(r.adapter is None for r in round_) == 11 and {r.adapter for r in round_} == {None, "x", "y"}
    small = warmup_round(cfg, max_model_len=2048, num_slots=4000, requests=4, tokens=8192, adapters=["x"])
    assert {len(r.prompt_ids) for r in small} == {250}  # 4000 // 4 slots over 4 requests


def test_warm_up_runs_each_adapter_alone_then_mixed_then_a_round_and_leaves_the_pool_empty():
    cfg = ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE))
    config = EngineConfig(device="cpu", dtype="float32", num_slots=4096, max_running_requests=16,
                          max_batched_tokens=512)
    packed = warmup_adapters(cfg, torch.float32, config.max_lora_rank)
    assert {n: p.ranks for n, p in packed.items()} == {WARMUP_ADAPTER: (8,) * 7, WIDE_ADAPTER: (64,) * 7}
    engine = Engine.with_dummy_weights(cfg, config, adapter_loader=WithWarmupAdapter(lambda name: None, packed))
    steps = []
    real_step = engine.step

    def step():  # the adapters of the running batch after each step, and its size
        outs = real_step()
        steps.append(({s.adapter.name for s in engine.running if s.adapter is not None},
                      {s.request_id for s in engine.running}))
        return outs

    engine.step = step
    warm_up(engine, cfg, adapters=list(packed))
    used = [names for names, _ in steps]
    assert {WIDE_ADAPTER} in used and {WARMUP_ADAPTER} in used  # each alone in a step
    assert {WARMUP_ADAPTER, WIDE_ADAPTER} in used  # and mixed
    round_ids = {f"warmup-round-{i}" for i in range(engine.admission_round)}
    assert any(ids == round_ids for _, ids in steps)  # the round was admitted and prefilled together
    # Then a round admitted beside a busy batch's decodes: one step holds the whole batch, both kinds in it.
    decode_ids = {f"warmup-decode-{i}" for i in range(config.max_running_requests - engine.admission_round)}
    mixed_ids = {f"warmup-mixed-{i}" for i in range(engine.admission_round)}
    assert any(ids == decode_ids | mixed_ids for _, ids in steps)
    assert engine.adapters.names == [] and engine.pool.allocator.num_used == engine.reserved_slots
    assert not engine.has_unfinished()


def test_warm_up_reports_the_gpu_memory_left_for_traffic():
    from services.gpu_worker.warmup import gpu_memory

    assert gpu_memory(torch.device("cpu")) == {}  # no GPU: nothing to report, nothing invented
    if not torch.cuda.is_available():
        return
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GB more, allocated and reserved
    got = gpu_memory(torch.device("cuda"))
    assert 0 < got["gpu_free_gb"] < got["gpu_total_gb"]
    assert 0.25 <= got["gpu_allocated_gb"] <= got["gpu_reserved_gb"] < got["gpu_total_gb"]
    del held
