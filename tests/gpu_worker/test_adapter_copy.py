"""An adapter copied into the pool while a step is still running on the GPU (a step launched ahead,
EngineConfig.overlap_steps) lands in the slots it was given, whatever the compute stream allocates and
writes meanwhile: the side stream runs behind that step and behind earlier copies, so it must not read
memory the host has already handed to the next step's inputs."""
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


def test_copy_queued_behind_earlier_copies_reads_the_slots_it_was_given(tmp_path):
    cfg = ModelConfig.from_dir(make_model(tmp_path / "model", preset="tiny-gqa", seed=1))
    width, layers, num_slots = cfg.kv_dim, cfg.num_layers, 4096
    pool = UnifiedPool(layers, num_slots, width, torch.float32, "cuda")
    copier = SideStreamCopier(pool)
    adapters = {f"a{i}": packed(f"a{i}", 16 + 8 * i, width, layers, seed=i) for i in range(6)}
    resident = ResidentAdapters(pool, cfg, max_resident=8, max_rank=64, loader=adapters.__getitem__,
                                copy_rows=copier.copy)
    decoy = num_slots - 1  # a valid slot no adapter here is given: a copy that reads it writes the wrong rows
    for name in adapters:
        # The side stream is still busy (earlier adapters' copies, tens of ms of them) when this one is queued.
        with torch.cuda.stream(copier.stream):
            torch.cuda._sleep(50_000_000)
        res = resident.acquire(name)
        assert decoy not in res.slots
        # The host builds the next step meanwhile: its small index tensors come from the compute stream's
        # cache and are written at once, long before the side stream reaches this adapter's scatter.
        scratch = [torch.full((n,), decoy, dtype=torch.long, device="cuda") for n in (8, 16, 24, 32, 48, 64) * 4]
        copier.order_before_compute()
        torch.cuda.synchronize()
        del scratch
        got = pool.kv[:, :, torch.tensor(res.slots, device="cuda")].cpu()
        torch.testing.assert_close(got, adapters[name].rows, rtol=0, atol=0)


def test_loading_an_adapter_does_not_wait_for_the_step_in_flight(tmp_path):
    """An admission scheduled ahead loads its adapters while the GPU still runs the last step: a blocking copy
    there (a device table written from a host list) would stall the host until that step ends."""
    cfg = ModelConfig.from_dir(make_model(tmp_path / "model", preset="tiny-gqa", seed=1))
    pool = UnifiedPool(cfg.num_layers, 4096, cfg.kv_dim, torch.float32, "cuda")
    copier = SideStreamCopier(pool)
    adapters = {f"a{i}": packed(f"a{i}", 16 + 8 * i, cfg.kv_dim, cfg.num_layers, seed=i) for i in range(3)}
    resident = ResidentAdapters(pool, cfg, max_resident=4, max_rank=64, loader=adapters.__getitem__,
                                copy_rows=copier.copy)
    torch.cuda._sleep(50_000_000)  # the step in flight
    torch.cuda.set_sync_debug_mode("error")  # any host wait on the device raises
    try:
        for name in adapters:
            assert resident.acquire(name) is not None
        copier.order_before_compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for name, res in resident._by_name.items():
        got = pool.kv[:, :, torch.tensor(res.slots, device="cuda")].cpu()
        torch.testing.assert_close(got, adapters[name].rows, rtol=0, atol=0)
        assert resident.tables.slots[res.resident_id, :len(res.slots)].tolist() == res.slots
        assert resident.tables.ranks[res.resident_id].tolist() == list(adapters[name].ranks)


def test_an_adapter_crosses_the_bus_during_the_step_in_flight_and_lands_after_it(tmp_path):
    """At n = 2000 every admission round loads adapters while the step before it still runs. Their copies
    from host memory need not wait for that step (they write fresh device memory), so they overlap it; the
    scatter into the pool must wait, since that step may still use the slots being overwritten."""
    cfg = ModelConfig.from_dir(make_model(tmp_path / "model", preset="tiny-gqa", seed=1))
    pool = UnifiedPool(cfg.num_layers, 4096, cfg.kv_dim, torch.float32, "cuda")
    copier = SideStreamCopier(pool)
    adapter = packed("a0", 64, cfg.kv_dim, cfg.num_layers, seed=3)
    slots = torch.arange(100, 100 + adapter.n_slots)
    on_device = slots.cuda()  # now: a copy from pageable memory queued after the sleep would wait for it
    # As in a serving worker, the staging stream already holds blocks from an earlier load (a cudaMalloc may
    # wait for the device whatever the stream).
    copier.copy(slots, adapter)
    copier.order_before_compute()
    # A tensor, made now: assigning a Python number through an index waits for the device.
    overwrite = torch.full(adapter.rows.shape, -1.0, device="cuda")
    torch.cuda.synchronize()
    # The step in flight: long on the GPU, and it writes the slots the adapter is about to be given (freed KV
    # of requests that leave in this step).
    torch.cuda._sleep(1_000_000_000)
    pool.kv[:, :, on_device] = overwrite
    step_done = torch.cuda.Event()
    step_done.record()
    read = copier.copy(slots, adapter)
    read.synchronize()
    assert not step_done.query(), "the host-to-device copy waited for the step in flight"
    copier.order_before_compute()
    torch.cuda.synchronize()
    torch.testing.assert_close(pool.kv[:, :, on_device].cpu(), adapter.rows, rtol=0, atol=0)
