"""The engine against transformers + peft: a batch mixing adapters of different ranks and target sets with
base-only requests, requests joining at different steps, in a roomy pool and in one so small that requests
are preempted and adapters evicted and reloaded."""
from __future__ import annotations

import random

import pytest

from services.gpu_worker.engine import Engine
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model
from tests.tp.workload import run as run_workload

from .oracle import HFOracle, make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16": dict(r=16, lora_alpha=8, target_modules=ALL),
    "r64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    # Per-module and per-layer ranks and alphas, rsLoRA scaling.
    "mixed": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj", "up_proj"],
                  rank_pattern={"down_proj": 12, "model.layers.0.self_attn.q_proj": 3},
                  alpha_pattern={"up_proj": 5}, use_rslora=True),
}
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_model(root / "model", preset=request.param, seed=3)
    dirs = {name: make_peft_adapter(base, root / name, seed=i + 10, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    cfg = ModelConfig.from_dir(base)
    weights = {name: load_adapter(d, cfg, max_rank=64, name=name) for name, d in dirs.items()}
    rng = random.Random(7)
    names = [None] + list(ADAPTERS)
    workload = []
    for i in range(14):
        length = rng.choice([1, 2, 5, 9, 17, 33, 40])
        prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(length)]
        workload.append((f"req{i}", prompt, names[i % len(names)], i // 3))  # (id, prompt, adapter, join step)
    oracle = HFOracle(base, dirs)
    expected = {rid: oracle.greedy(prompt, adapter, MAX_TOKENS) for rid, prompt, adapter, _ in workload}
    return base, weights, workload, expected


def run_engine(base, weights, workload, **config) -> tuple[Engine, dict, dict]:
    engine = Engine.from_model_dir(base, EngineConfig(max_lora_rank=64, max_resident_adapters=8, **config))
    tokens, logits = run_workload(engine, weights, workload, MAX_TOKENS)
    assert not engine.has_unfinished(), "engine did not finish"
    return engine, tokens, logits


def assert_matches(expected, tokens, logits):
    for rid, (ref_tokens, ref_logits) in expected.items():
        assert tokens[rid] == ref_tokens, f"{rid}: engine {tokens[rid]} != reference {ref_tokens}"
        for step, (ours, ref) in enumerate(zip(logits[rid], ref_logits)):
            diff = (ours - ref).abs().max().item()
            assert diff < 1e-4, f"{rid} step {step}: logits differ by {diff}"


def test_mixed_adapter_batch_matches_transformers_peft(setup):
    base, weights, workload, expected = setup
    engine, tokens, logits = run_engine(base, weights, workload, num_slots=4096)
    assert_matches(expected, tokens, logits)
    assert engine.num_preemptions == 0
    assert engine.adapters.loads == len(ADAPTERS)  # each loaded once, kept while there is room
    # Everything finished: no KV slot is held, only the (cached, unused) adapters' slots.
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use


def test_tiny_pool_preempts_and_reloads_yet_output_is_unchanged(setup):
    base, weights, workload, expected = setup
    cfg = ModelConfig.from_dir(base)
    from services.gpu_worker.adapter_layout import pack_adapter

    # The rank-64 adapter alone would need most of a pool this small; the other four share it.
    # Everyone arrives at once, small adapters first: many requests get in, then outgrow the pool while
    # they decode, and the big adapter later pushes the small ones out.
    order = [None, "r1", "mixed", "r8", "r16"]
    workload = sorted(((rid, prompt, adapter, 0) for rid, prompt, adapter, _ in workload if adapter != "r64"),
                      key=lambda w: order.index(w[2]))
    expected = {w[0]: expected[w[0]] for w in workload}
    largest = max(pack_adapter(w, cfg, cfg.kv_dim).n_slots for n, w in weights.items() if n != "r64")
    # Room for the largest adapter plus a few requests' KV, far less than the workload wants at once.
    engine, tokens, logits = run_engine(base, weights, workload, num_slots=largest + 60, max_batched_tokens=256)
    assert_matches(expected, tokens, logits)
    assert engine.num_preemptions > 0, "pool was meant to be small enough to force preemption"
    assert engine.adapters.loads > len(ADAPTERS) - 1, "adapters were meant to be evicted and reloaded"
    assert engine.pool.allocator.num_used == engine.adapters.slots_in_use
