"""An adapter copied into the pool while a step is still running on the GPU (a step launched ahead,
EngineConfig.overlap_steps) lands in the slots it was given, whatever the compute stream allocates and
writes meanwhile: the side stream waits behind that step and must not read memory the host has already
handed to the next step's inputs."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.adapter_copy import SideStreamCopier
from services.gpu_worker.adapter_layout import PackedAdapter
from services.gpu_worker.pool import UnifiedPool
from services.gpu_worker.resident_adapters import ResidentAdapters
from shared.model_config import MODULES
from shared.tiny_model import make_model
from shared.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="side-stream copies need CUDA")


def packed(name: str, n_slots: int, width: int, layers: int, seed: int) -> PackedAdapter:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(layers, 2, n_slots, width, generator=g).pin_memory()
    ranks = (n_slots // 2,) + (0,) * (len(MODULES) - 1)
    return PackedAdapter(name, rows, ranks, (0,) * len(MODULES), (n_slots // 2,) + (0,) * (len(MODULES) - 1))


def test_copy_behind_a_running_step_survives_the_next_steps_allocations(tmp_path):
    cfg = ModelConfig.from_dir(make_model(tmp_path / "model", preset="tiny-gqa", seed=1))
    width, layers = cfg.kv_dim, cfg.num_layers
    pool = UnifiedPool(layers, 4096, width, torch.float32, "cuda")
    copier = SideStreamCopier(pool)
    adapters = {f"a{i}": packed(f"a{i}", 16 + 8 * i, width, layers, seed=i) for i in range(6)}
    resident = ResidentAdapters(pool, cfg, max_resident=8, max_rank=64, loader=adapters.__getitem__,
                                copy_rows=copier.copy)
    for name in adapters:
        torch.cuda._sleep(50_000_000)  # the step in flight: tens of ms of GPU time on the compute stream
        res = resident.acquire(name)
        # The host builds the next step meanwhile: its small index tensors come from the compute stream's
        # cache and are filled with ids far out of the pool's range.
        scratch = [torch.full((n,), 10**9, dtype=torch.long, device="cuda") for n in (8, 16, 24, 32, 48, 64) * 4]
        copier.order_before_compute()
        torch.cuda.synchronize()
        del scratch
        got = pool.kv[:, :, torch.tensor(res.slots, device="cuda")].cpu()
        torch.testing.assert_close(got, adapters[name].rows, rtol=0, atol=0)
