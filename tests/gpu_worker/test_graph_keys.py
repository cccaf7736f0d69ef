"""Which decode graph each step replays, decided on the host: batch bucket, rank bucket, LoRA launch plan and
the LoRA groups its adapters adapt. Runs on the CPU with CUDA's graph API stood in for (capture runs the
forward once, replay does nothing), so the tokens are not checked here; graph replay against eager steps on
a GPU is tests/gpu_worker/test_cuda_graphs.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from services.gpu_worker.cuda_graphs import StackPlan, batch_buckets
from services.gpu_worker.engine import Engine
from services.gpu_worker.held_stacks import HeldStacks
from services.gpu_worker.model import DOWN, GATE_UP, O, QKV
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

from .oracle import make_peft_adapter


class _Stream:
    def __init__(self, *args):
        pass

    def wait_stream(self, other):
        pass


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass


class _Graph:
    def replay(self):
        pass


@pytest.fixture
def cuda_graph_api(monkeypatch):
    """The CUDA graph, stream and pinned-memory calls DecodeGraphs makes, as no-ops on the CPU."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)


@pytest.mark.parametrize("few_adapters,stacked", [(0, False), (2, False), (4, False), (4, True)])
def test_each_step_replays_the_graph_of_its_adapters_groups_and_plan(tmp_path, cuda_graph_api, few_adapters, stacked):
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    cfg = ModelConfig.from_dir(base)
    adapters = {  # q,v,o: the q,k,v and o groups; k, gate, down: q,k,v, gate,up and down
        "attn": load_adapter(make_peft_adapter(base, tmp_path / "attn", 1, r=4, lora_alpha=8,
                                               target_modules=["q_proj", "v_proj", "o_proj"]), cfg, 32),
        "mlp": load_adapter(make_peft_adapter(base, tmp_path / "mlp", 2, r=32, lora_alpha=16,
                                              target_modules=["k_proj", "gate_proj", "down_proj"]), cfg, 32),
    }
    engine = Engine.from_model_dir(base, EngineConfig(device="cpu", num_slots=2048, max_lora_rank=32,
                                                      max_resident_adapters=4, cuda_graph_max_batch=8,
                                                      cuda_graph_few_adapters=few_adapters,
                                                      cuda_graph_segment_programs=2,
                                                      kernel_shapes="" if stacked else "no_graph_few_stacked"))
    if stacked:  # the defaults' held buffers, as a CUDA engine takes them before its pool
        engine.held_stacks = HeldStacks(cfg, (QKV, O, GATE_UP, DOWN), cfg.kv_dim, 256, engine.dtype, "cpu")
    engine.graphs = engine._decode_graphs()  # as a CUDA engine builds them
    for name, w in adapters.items():
        engine.register_adapter(name, w)
    # Each request runs longer than the one before: the mlp adapter's last request ends before the
    # attention adapter's, which then decodes beside a base-model one.
    names = [None, "mlp", "attn", None, "mlp", None, "attn"]
    for i, name in enumerate(names):
        engine.add_request(EngineRequest(f"q{i}", [3 + i, 5, 7], SamplingParams(max_tokens=2 + 2 * i, ignore_eos=True),
                                         name))
    while engine.has_unfinished():
        engine.step()
    keys = set(engine.graphs.graphs)
    assert keys, "no decode step was replayed"
    attn_only, every_group = (True, True, False, False), (True, True, True, True)
    # Batches holding the mlp adapter run its groups as well; once it has finished, the attention groups alone.
    assert {k[4] for k in keys if k[1]} == {attn_only, every_group}
    # Rank buckets follow the batch's largest rank: 16 for the rank-4 adapter alone, 32 with the rank-32 one.
    assert {(k[1], k[4]) for k in keys if k[1]} == {(16, attn_only), (32, every_group)}
    # The few-adapter plan: never without it; with 2, only batches of at most 2 busy segments (a bucket of
    # <= 2 requests, or the attention adapter with the base model); with 4, every LoRA step. With the stacked
    # products on (the defaults), every LoRA step (at most the two adapters: 4 + 32 of 64 columns) replays
    # a stacked graph over the held rows instead.
    plans = {k[3] for k in keys if k[1]}
    if stacked:
        assert plans == {StackPlan(64, True)} and engine.graphs.stacks.held_stacks.gathers >= 2
    else:
        assert plans == {0: {False}, 2: {True, False}, 4: {True}}[few_adapters]
    if few_adapters == 2:
        assert all(few == (size <= 2 or groups == attn_only) for size, rank, _, few, groups in keys if rank)
    # Base-only steps replay graphs without LoRA.
    assert all(k[4] == (False,) * 4 for k in keys if not k[1])


@pytest.mark.parametrize("shapes,size", [("", 320), ("graph_batch_step=32", 288), ("graph_batch_step=16", 272)])
def test_a_step_replays_the_smallest_batch_bucket_its_setting_captures(tmp_path, cuda_graph_api, shapes, size):
    """270 rows: past 256 the graphs come every 64 rows by default, so the step pads to 320 (its base GEMMs
    compute the 50 padding rows); graph_batch_step=32 and 16 capture batches nearer its rows."""
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    engine = Engine.from_model_dir(base, EngineConfig(device="cpu", num_slots=4096, max_running_requests=320,
                                                      cuda_graph_max_batch=320, kernel_shapes=shapes))
    engine.graphs = engine._decode_graphs()
    for i in range(270):
        engine.add_request(EngineRequest(f"r{i}", [3 + i % 50, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert {k[0] for k in engine.graphs.graphs} == {size}
    # Its graph was captured under load, inside a step, and counted there with the host's time in it.
    stats = engine.step_stats
    assert stats.captures["graph"] == engine.graphs.live_captures == 1 and stats.captures["prefill"] == 0
    assert stats.capture_seconds["graph"] == engine.graphs.live_capture_s > 0


def test_graphs_captured_at_warm_up_are_not_counted_as_captured_under_load(tmp_path, cuda_graph_api):
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    engine = Engine.from_model_dir(base, EngineConfig(device="cpu", num_slots=2048, cuda_graph_max_batch=4))
    engine.graphs = engine._decode_graphs()
    warmed = engine.graphs.capture_all(max_context=64, deadline=float("inf"))
    assert warmed == len(engine.graphs.graphs) > 0 and engine.graphs.live_captures == 0
    for i in range(3):  # base-model requests: their steps replay graphs the warm-up captured
        engine.add_request(EngineRequest(f"r{i}", [3 + i, 5], SamplingParams(max_tokens=4, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert engine.step_stats.steps["graph"] >= 3 and engine.step_stats.captures["graph"] == 0
    assert len(engine.graphs.graphs) == warmed


def test_batch_buckets_follow_the_step_past_256_and_end_at_the_largest_batch():
    small = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert batch_buckets(512) == small + (160, 192, 224, 256, 320, 384, 448, 512)  # the buckets before the word
    assert batch_buckets(384, 32) == small + (160, 192, 224, 256, 288, 320, 352, 384)
    assert batch_buckets(256, 16)[len(small):] == tuple(range(144, 257, 16))
    assert batch_buckets(100) == small[:-1] + (100,) and batch_buckets(600)[-3:] == (512, 576, 600)
