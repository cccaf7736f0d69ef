"""The CUDA op backend (Triton kernels, run by the interpreter on the CPU) under TP=2: the per-rank shrink
tables, the interleaved all-gather and the row-parallel expand into a column slice of the base partial sum
give the single-GPU reference output."""
from __future__ import annotations

import os

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.tp import TPEngine
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

from .adapters import ALL, random_adapter
from .workload import assert_same_output, make_workload, run

pytestmark = pytest.mark.timeout(240)


def test_tp2_with_triton_kernels_matches_the_reference_ops(tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the Triton interpreter is off (tests/conftest.py)")
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=5)
    cfg = ModelConfig.from_dir(base)
    adapters = {"r1": random_adapter(cfg, "r1", 1, ["q_proj", "v_proj"], seed=1),
                "r5": random_adapter(cfg, "r5", 5, ALL, seed=2),
                "r16": random_adapter(cfg, "r16", 16, ["k_proj", "o_proj", "down_proj"], seed=3)}
    workload = make_workload(cfg.vocab_size, [None, "r1", "r5", "r16"], count=4)
    config = EngineConfig(max_lora_rank=16, max_resident_adapters=4)
    expected = run(Engine.from_model_dir(base, config, backend="reference"), adapters, workload, max_tokens=3)
    with TPEngine.from_model_dir(base, config, tp_size=2, backend="triton", log_level="warning") as engine:
        got = run(engine, adapters, workload, max_tokens=3)
    assert_same_output(expected, got, max_tokens=3)
