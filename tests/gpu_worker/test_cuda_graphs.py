"""Graph-replayed decode steps give the eager path's tokens and logits (needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.cuda_graphs import StackPlan
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

from .oracle import make_peft_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def run(base, adapters, graphs: bool, few_adapters: int = 0, kernel_shapes: str = "no_graph_few_stacked"):
    """The engine's tokens and logits for 11 requests. By default on the segment kernels only: the stacked
    products (on by default in the worker) take every LoRA step over at most 8 adapters, which here is all."""
    engine = Engine.from_model_dir(base, EngineConfig(device="cuda", num_slots=2048, max_lora_rank=32,
                                                      max_resident_adapters=4, cuda_graphs=graphs,
                                                      cuda_graph_max_batch=8, cuda_graph_few_adapters=few_adapters,
                                                      cuda_graph_segment_programs=2, kernel_shapes=kernel_shapes))
    for name, w in adapters.items():
        engine.register_adapter(name, w)
    names = [None, "r4", "r32"]
    # 11 requests: more than the largest graph bucket, so early decode steps run eagerly; requests end
    # one by one, so later steps replay graphs of shrinking batch buckets.
    for i in range(11):
        prompt = [(7 * i + j) % 500 + 3 for j in range(3 + 2 * i)]
        engine.add_request(EngineRequest(f"q{i}", prompt, SamplingParams(max_tokens=3 + i, ignore_eos=True),
                                         names[i % 3], return_logits=True))
    tokens, logits = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).extend(out.logits or [])
    return engine, tokens, logits


def assert_eager_agrees(base, adapters, tokens: dict, logits: dict) -> None:
    """The eager path over the same requests gives the same tokens, and logits within its rounding."""
    _, eager_tokens, eager_logits = run(base, adapters, graphs=False)
    assert tokens == eager_tokens
    for rid in tokens:
        for a, b in zip(logits[rid], eager_logits[rid]):
            assert (a - b).abs().max().item() < 1e-3


def adapters_of(base, tmp_path) -> dict:
    cfg = ModelConfig.from_dir(base)
    return {
        "r4": load_adapter(make_peft_adapter(base, tmp_path / "r4", 1, r=4, lora_alpha=8,
                                             target_modules=["q_proj", "v_proj", "o_proj"]), cfg, 32),
        "r32": load_adapter(make_peft_adapter(base, tmp_path / "r32", 2, r=32, lora_alpha=16,
                                              target_modules=["k_proj", "gate_proj", "down_proj"]), cfg, 32),
    }


# few_adapters 2: batches of the three (base, r4, r32) replay the every-segment plan, smaller ones the
# few-adapter plan; 4: every LoRA step replays the few-adapter plan, 2 programs sharing 3 busy segments.
@pytest.mark.parametrize("few_adapters", [0, 2, 4])
def test_graph_replay_matches_eager(tmp_path, few_adapters):
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    adapters = adapters_of(base, tmp_path)
    graph_engine, tokens, logits = run(base, adapters, graphs=True, few_adapters=few_adapters)
    assert graph_engine.graphs is not None and graph_engine.graphs.graphs, "no decode step was replayed"
    keys = [key for key in graph_engine.graphs.graphs if key[1]]
    assert {few for _, _, _, few, _ in keys} == {0: {False}, 2: {False, True}, 4: {True}}[few_adapters]
    # Steps of r4 (q,v,o) alone run the q,k,v and o groups only; steps with r32 (k, gate, down) more.
    groups = {g for *_, g in keys}
    assert (True, True, False, False) in groups and len(groups) > 1
    # Every graph writes the one logits buffer: none keeps a [batch, vocab] output of its own in the pool. The
    # last step replayed a graph for q10 alone (the longest request): its logits are still in row 0.
    assert torch.equal(graph_engine.graphs.logits[0].cpu(), logits["q10"][-1])
    # Every step sampled and was timed on the GPU, about within its own wall time (a step launched ahead starts
    # on the GPU a little before the host has read the step before's tokens, where its wall time starts).
    stats = graph_engine.step_stats
    assert stats.gpu_steps == stats.steps and stats.captures["graph"] == len(graph_engine.graphs.graphs)
    assert all(0 < stats.gpu_seconds[kind] <= 1.1 * stats.seconds[kind] + 1e-3 for kind in stats.steps
               if stats.steps[kind])
    assert_eager_agrees(base, adapters, tokens, logits)


def test_warm_up_captures_every_graph_of_its_plan(tmp_path):
    # The stacked graphs of steps over at most 8 adapters (on by default) are not in the plan: captured at first
    # use (cuda_graphs.py).
    from services.gpu_worker.cuda_graphs import capture_plan
    from services.gpu_worker.warmup import capture_graphs

    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    engine = Engine.from_model_dir(base, EngineConfig(device="cuda", num_slots=4096, max_lora_rank=32,
                                                      cuda_graph_max_batch=8, max_model_len=1500,
                                                      cuda_graph_max_context=1024, cuda_graph_few_adapters=2,
                                                      cuda_graph_lora_targets="q_proj,v_proj,o_proj"))
    graphs = engine.graphs
    assert graphs.context_buckets(1024) == (512, 1024)
    assert not graphs.graphs
    expected = capture_plan(graphs.batch_buckets, graphs.rank_buckets, (512, 1024), few_adapters=2,
                            groups=(True, True, False, False))
    assert capture_graphs(engine) == len(expected)
    assert set(graphs.graphs) == set(expected)
    # Nothing is captured twice, and a deadline already past captures nothing more.
    assert graphs.capture_all(1024, deadline=float("inf")) == 0
    assert graphs.capture_all(2048, deadline=0.0) == 0


def test_few_adapter_graphs_with_their_lora_tiles_dealt_match_eager(tmp_path):
    # kernel_shapes graph_few_shrink_deal and graph_few_expand_deal: the few-adapter graphs' shrink and expand
    # programs are dealt the busy segments' token tiles; the tokens stay the eager path's, the logits within
    # its rounding.
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    adapters = adapters_of(base, tmp_path)
    graph_engine, tokens, logits = run(base, adapters, graphs=True, few_adapters=4,
                                       kernel_shapes="no_graph_few_stacked,graph_few_shrink_deal,graph_few_expand_deal")
    assert {key[3] for key in graph_engine.graphs.graphs if key[1]} == {True}
    assert_eager_agrees(base, adapters, tokens, logits)


@pytest.mark.parametrize("held", [False, True])
def test_stacked_few_adapter_graphs_match_eager(tmp_path, held):
    # kernel_shapes graph_few_stacked=4: every LoRA decode step (at most the two adapters) replays a graph whose
    # LoRA is dense products over their rows side by side, 4 + 32 of 64 columns, gathered every step or (held)
    # from the held buffers, gathered again as the mix changes; the tokens stay the eager path's, the logits
    # within its rounding.
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=4)
    adapters = adapters_of(base, tmp_path)
    shapes = "graph_few_stacked=4," + ("graph_stacked_held=64" if held else "no_graph_stacked_held")
    graph_engine, tokens, logits = run(base, adapters, graphs=True, few_adapters=4, kernel_shapes=shapes)
    assert {key[3] for key in graph_engine.graphs.graphs if key[1]} == {StackPlan(64, held)}
    stacks = graph_engine.graphs.stacks
    assert stacks.fills >= 2  # the mix changes as requests end
    assert (stacks.held_stacks.gathers >= 2) if held else stacks.held_stacks is None
    assert_eager_agrees(base, adapters, tokens, logits)
