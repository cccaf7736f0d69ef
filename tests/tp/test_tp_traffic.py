"""The collective traffic the TP forward counts, step by step, equals the S-LoRA paper's formula: base
2·(N−1)/N·B·h per row-parallel all-reduce, LoRA on q,k,v,o 5·(N−1)/N·B·r per layer."""
from __future__ import annotations

from fractions import Fraction

import pytest

from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from services.gpu_worker.tp import TPEngine
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

from .adapters import ALL, random_adapter

pytestmark = pytest.mark.timeout(180)
FP32 = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tp-traffic") / "model", preset="tiny", seed=1)


def run_steps(engine, prompts: list[int], adapter: str | None) -> list[dict]:
    """Prefill then one decode step for requests with these prompt lengths; each step's traffic."""
    for i, length in enumerate(prompts):
        engine.add_request(EngineRequest(f"{adapter}-{i}", list(range(3, 3 + length)),
                                         SamplingParams(max_tokens=2, ignore_eos=True), adapter))
    steps = []
    while engine.has_unfinished():
        engine.step()
        t = engine.last_step_traffic
        steps.append({k: (t[k].calls, t[k].sent_bytes) for k in ("base_all_reduce", "lora_all_gather", "lora_all_reduce")})
    return [s for s in steps if s["base_all_reduce"][0] > 0]


@pytest.mark.parametrize("tp", [2, 4])
def test_counted_bytes_equal_the_papers_formula(base, tp):
    cfg = ModelConfig.from_dir(base)
    n, h, layers = tp, cfg.hidden_size, cfg.num_layers
    prompts = [4, 2, 7]
    with TPEngine.from_model_dir(base, EngineConfig(max_lora_rank=64), tp_size=tp, log_level="warning") as engine:
        engine.register_adapter("qkvo16", random_adapter(cfg, "qkvo16", 16, ["q_proj", "k_proj", "v_proj", "o_proj"]))
        engine.register_adapter("all8", random_adapter(cfg, "all8", 8, ALL))
        engine.register_adapter("odd5", random_adapter(cfg, "odd5", 5, ["q_proj", "v_proj", "o_proj"]))
        lora_qkvo = run_steps(engine, prompts, "qkvo16")
        lora_all = run_steps(engine, prompts, "all8")
        lora_odd = run_steps(engine, prompts, "odd5")
        base_only = run_steps(engine, prompts, None)

    for steps in (lora_qkvo, lora_all, lora_odd, base_only):
        assert [len(steps)] == [2]  # one prefill step, one decode step

    def base_bytes(tokens):  # two all-reduces (after o, after down) of (B, h) per layer
        return layers * 2 * Fraction(2 * (n - 1), n) * tokens * h * FP32

    for steps in (lora_qkvo, lora_all, lora_odd, base_only):
        for step, tokens in zip(steps, (sum(prompts), len(prompts))):
            assert step["base_all_reduce"] == (2 * layers, base_bytes(tokens))

    # The paper's formula: q,k,v,o adapters add 5·(N−1)/N·B·r elements per layer.
    for step, tokens in zip(lora_qkvo, (sum(prompts), len(prompts))):
        gathered, reduced = step["lora_all_gather"], step["lora_all_reduce"]
        assert gathered[0] == reduced[0] == layers  # one fused q/k/v all-gather, one o all-reduce per layer
        assert gathered[1] + reduced[1] == layers * Fraction(5 * (n - 1), n) * tokens * 16 * FP32
        lora_share = (gathered[1] + reduced[1]) / base_bytes(tokens)
        assert lora_share == Fraction(5 * 16, 4 * h)  # vs both base all-reduces of the layer

    # All seven modules: gate/up add two more gathers, down one more all-reduce: 9·(N−1)/N·B·r.
    for step, tokens in zip(lora_all, (sum(prompts), len(prompts))):
        assert step["lora_all_gather"][0] == 2 * layers and step["lora_all_reduce"][0] == 2 * layers
        total = step["lora_all_gather"][1] + step["lora_all_reduce"][1]
        assert total == layers * Fraction(9 * (n - 1), n) * tokens * 8 * FP32

    # Rank 5 is not divisible by N: the gather is padded to N·ceil(5/N) columns, the all-reduce is exact.
    for step, tokens in zip(lora_odd, (sum(prompts), len(prompts))):
        padded = n * -(-5 // n)
        assert step["lora_all_gather"][1] == layers * 3 * Fraction(n - 1, n) * tokens * padded * FP32
        assert step["lora_all_reduce"][1] == layers * Fraction(2 * (n - 1), n) * tokens * 5 * FP32

    for step in base_only:
        assert step["lora_all_gather"] == (0, 0) and step["lora_all_reduce"] == (0, 0)
