"""The forward's `logits_out`: every decode graph writes its logits into one buffer (cuda_graphs.py), so the
logits must come out the same as the forward's own, in the buffer itself, through whole engine runs whose
steps write one buffer in turn."""
from __future__ import annotations

import torch

from services.gpu_worker.engine import Engine
from shared.config import EngineConfig
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.adapter_format import load_adapter
from shared.tiny_model import make_model
from tests.tp.workload import assert_same_output, make_workload, run


def engine_for(base) -> Engine:
    return Engine.from_model_dir(base, EngineConfig(max_lora_rank=16, max_resident_adapters=4))


def test_logits_written_into_one_shared_buffer_match_the_forwards_own(tmp_path):
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=6)
    cfg = ModelConfig.from_dir(base)
    folders = make_adapters(tmp_path / "adapters", base, 2, ranks=[4, 16], seed=11)
    adapters = {f"a{i}": load_adapter(folder, cfg, name=f"a{i}") for i, folder in enumerate(folders)}
    workload = make_workload(cfg.vocab_size, [None, "a0", "a1"])
    expected = run(engine_for(base), adapters, workload)

    engine = engine_for(base)
    shared = torch.full((64, cfg.vocab_size), float("nan"))
    forward, seen = engine.model.forward, []

    def into_shared(batch, pool):
        n = batch.logits_index.shape[0]
        own = forward(batch, pool)
        out = forward(batch, pool, logits_out=shared[:n])
        assert out.data_ptr() == shared.data_ptr() and out.dtype == torch.float32
        assert torch.equal(out, own)
        seen.append(n)
        return out

    engine.model.forward = into_shared
    assert_same_output(expected, run(engine, adapters, workload))
    assert len(seen) > 3 and len(set(seen)) > 1, seen  # steps of different sizes took turns in the buffer
