"""`python -m services.gpu_worker --model DIR | --dummy-weights CONFIG [options]`: one worker process."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import zmq

from shared.config import EngineConfig
from shared.log import configure_logging, get_logger
from shared.model_config import ModelConfig

from .arena_client import ArenaAdapterLoader, ArenaSegments, StoreClient
from .engine import DTYPES
from .service import WorkerService, install_signal_handlers
from .warmup import WithWarmupAdapter, warm_up, warmup_adapters
from .worker_config import WorkerConfig, parse_args

log = get_logger(__name__)
# The store is up long before a worker has loaded its model; a silent one leaves the arena unpinned.
ARENA_NAME_TIMEOUT_S = 10.0


def engine_class(tp: int):
    """Engine for one device, or the tensor-parallel engine (same API) across `tp` devices."""
    if tp == 1:
        from .engine import Engine
        return Engine
    try:
        from .tp import TPEngine
    except ImportError as e:
        raise SystemExit(f"--tp {tp}: tensor parallelism is not available yet in this build ({e})") from None
    return TPEngine


def build_engine(worker: WorkerConfig, engine: EngineConfig, loader):
    cls = engine_class(worker.tp)
    kw = {"adapter_loader": loader, "backend": worker.backend}
    if worker.tp > 1:
        kw["tp_size"] = worker.tp
    if worker.model:
        return cls.from_model_dir(worker.model, engine, **kw)
    path = Path(worker.dummy_weights)
    return cls.with_dummy_weights(ModelConfig.from_dir(path if path.is_dir() else path.parent), engine, **kw)


def model_geometry(worker: WorkerConfig) -> ModelConfig:
    path = Path(worker.model or worker.dummy_weights)
    return ModelConfig.from_dir(path if path.is_dir() else path.parent)


def main(argv: list[str] | None = None) -> int:
    worker, engine_config = parse_args(argv)
    configure_logging()
    ctx = zmq.Context()
    cfg = model_geometry(worker)
    device = torch.device(engine_config.device)
    segments = ArenaSegments(register_with_cuda=device.type == "cuda")
    store = StoreClient(ctx, worker.store_addr, worker.worker_id, worker.acquire_timeout_s)
    loader = ArenaAdapterLoader(store, segments, cfg.num_layers, cfg.kv_dim,
                                load_timeout_s=worker.adapter_load_timeout_s)
    warm = worker.warmup == "on" or (worker.warmup == "auto" and device.type == "cuda")
    packed = warmup_adapters(cfg, DTYPES[engine_config.dtype], engine_config.max_lora_rank) if warm else {}
    engine = build_engine(worker, engine_config, WithWarmupAdapter(loader, packed) if warm else loader)
    service = None
    try:
        arena = store.arena_name(timeout_s=ARENA_NAME_TIMEOUT_S) if segments.register_with_cuda else ""
        segments.populate_at_start(arena)  # its pages fault in while the graphs are captured
        if warm:
            warm_up(engine, cfg, adapters=list(packed))
        if segments.register_with_cuda and not arena:  # the store was not up yet (services started together)
            arena = store.arena_name(timeout_s=ARENA_NAME_TIMEOUT_S)
        # Before the worker reports ready: pinning a large arena takes seconds (ArenaSegments).
        segments.pin_at_start(arena)
        service = WorkerService(worker, engine, loader, ctx)
        install_signal_handlers(service)
        log.info("worker.started", worker=worker.worker_id, device=str(device), slots=engine.pool.num_slots,
                 model=worker.model or worker.dummy_weights)
        service.run()
    finally:
        if service is not None:
            service.close()
        if hasattr(engine, "shutdown"):
            engine.shutdown()  # tensor-parallel followers
        store.close()
        segments.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
