"""TPEngine: the engine over N tensor-parallel ranks, with the same API as `Engine`.

This process is rank 0: it runs the engine's scheduling (the very same `Engine` code: admission, slot
allocation, adapter residency, preemption, sampling) over its own pool shard, and before every forward it
sends the step's plan to the N−1 follower processes it spawned, which run the same forward on their shards.
Rank 0's engine sees its shard as a narrower model (`TPLayout.local_config`: heads/N, KV heads/N,
intermediate/N), so its pool, adapter tables and slot accounting come out shard-sized with no TP logic in the
engine; rank 0's allocator decides every slot id and the followers use the same ids.

    engine = TPEngine.from_model_dir(model_dir, EngineConfig(device="cuda"), tp_size=2)
    engine.register_adapter("a", lora_weights)      # or adapter_loader=name -> PackedAdapter (single-GPU format)
    engine.add_request(EngineRequest(...)); outputs = engine.step(); engine.abort(id); engine.capacity()
    engine.last_step_traffic / engine.total_traffic  # collective bytes by kind
    engine.shutdown()                                # or use it as a context manager

One TPEngine per process at a time with tp_size > 1 (torch.distributed keeps one default group per process).
"""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from shared.config import EngineConfig
from shared.log import get_logger
from shared.lora_weights import LoraWeights
from shared.model_config import ModelConfig

from ..adapter_layout import PackedAdapter, pack_adapter
from ..engine import DTYPES, Engine
from ..pool import UnifiedPool
from ..resident_adapters import Resident, ResidentAdapters
from .adapter_shards import shard_packed
from .comm import TPComm, Traffic
from .group import FollowerGroup
from .layout import TPLayout
from .model import TPLlamaModel
from .plan import INIT_DONE, READY, AdapterLoad
from .shard_weights import load_shard
from .spec import model_config_to_dict, rank_device

log = get_logger(__name__)


class TPResidentAdapters(ResidentAdapters):
    """Rank 0's resident adapters. The loader gives the adapter in single-GPU row format; it is cut into
    every rank's share, rank 0 keeps its own, and each load is queued for the next step plan so the
    followers copy their shares into the same slots and table row."""

    def __init__(self, pool: UnifiedPool, local_cfg: ModelConfig, max_resident: int, max_rank: int,
                 loader: Callable[[str], PackedAdapter], layout: TPLayout,
                 copy_rows: Callable[[torch.Tensor, PackedAdapter], None] | None = None):
        self.layout = layout
        self.full_loader = loader
        # Every rank's share of adapters loaded but not yet in the pool (the base class may fetch an adapter
        # to learn its size well before it pins it).
        self._shards: dict[str, list[PackedAdapter]] = {}
        self.pending: list[AdapterLoad] = []
        super().__init__(pool, local_cfg, max_resident, max_rank, self._load_shards, copy_rows)

    def _load_shards(self, name: str) -> PackedAdapter:
        packed = self.full_loader(name)
        if packed.rows.shape[0] != self.layout.cfg.num_layers:
            raise ValueError(f"adapter {name!r} has {packed.rows.shape[0]} layers, the model {self.layout.cfg.num_layers}")
        shards = shard_packed(packed, self.layout, self.pool.dtype)
        self._shards[name] = shards
        return shards[0]

    def acquire(self, name: str) -> Resident | None:
        loads = self.loads
        res = super().acquire(name)
        if self.loads != loads:
            shards = self._shards.pop(name)
            if self.layout.size > 1:
                self.pending.append(AdapterLoad(res.resident_id, name, list(res.slots), shards))
        return res

    def take_pending(self) -> list[AdapterLoad]:
        out, self.pending = self.pending, []
        return out


class LeaderModel:
    """What the engine calls `model`: send the plan, then run rank 0's share of the forward."""

    def __init__(self, model: TPLlamaModel, adapters: TPResidentAdapters, followers: FollowerGroup | None):
        self.model = model
        self.adapters = adapters
        self.followers = followers

    def forward(self, batch, pool: UnifiedPool) -> torch.Tensor:
        loads = self.adapters.take_pending()
        if self.followers is None:
            return self.model.forward(batch, pool)
        self.followers.send_step(batch, loads)
        try:
            return self.model.forward(batch, pool)
        except RuntimeError as e:  # a collective failed: most likely a follower died; say which and why
            raise self.followers.failure(e) from e


class TPEngine(Engine):
    def __init__(self, cfg: ModelConfig, config: EngineConfig, tp_size: int, weights: dict,
                 adapter_loader: Callable[[str], PackedAdapter] | None = None, backend: str = "auto",
                 start_timeout_s: float = 300.0, collective_timeout_s: float = 300.0, log_level: str = "info"):
        """`weights`: `{"model_dir": path}` or `{"dummy_seed": n}`, loaded by every rank itself.
        `adapter_loader(name)`: the adapter in single-GPU pool row format (`pack_adapter` for the full model
        at any slot width, as the host arena holds it); unknown names raise KeyError. Default: adapters given
        to `register_adapter`."""
        self.layout = TPLayout(cfg, tp_size)
        self.full_cfg = cfg
        self.tp_size = tp_size
        self.followers: FollowerGroup | None = None
        self._registered: dict[str, PackedAdapter] = {}
        self.total_traffic = Traffic()
        self._owns_process_group = False
        device = rank_device(config.device, 0)
        dtype = DTYPES[config.dtype]
        try:
            if tp_size > 1:
                self._start_followers(cfg, config, weights, backend, start_timeout_s, collective_timeout_s,
                                      log_level, device)
            shard = load_shard(weights, self.layout, 0, dtype, device)
            if self.followers is not None:
                self.followers.wait_all(READY, start_timeout_s, "ready (weights loaded)")
                self._join_process_group(device, start_timeout_s, collective_timeout_s)
            super().__init__(self.layout.local_config(), shard, self._rank0_config(config, device), backend=backend)
            comm = self._make_comm(device)
            tp_model = TPLlamaModel(self.layout, 0, shard, self.ops, self.max_model_len, comm)
            self.adapters = TPResidentAdapters(self.pool, self.cfg, config.max_resident_adapters,
                                               config.max_lora_rank, adapter_loader or self._registered_adapter,
                                               self.layout, copy_rows=self.adapters.copy_rows)
            self.model = LeaderModel(tp_model, self.adapters, self.followers)
            self.comm = comm
            if self.followers is not None:
                self.followers.send_init(num_slots=self.pool.num_slots, max_resident=config.max_resident_adapters,
                                         max_slots=self.adapters.max_slots, max_model_len=self.max_model_len)
                self.followers.wait_all(INIT_DONE, start_timeout_s, "set up (pool shard allocated)")
        except BaseException:
            self.shutdown()
            raise
        log.info("tp.engine_ready", tp=tp_size, slot_width=self.layout.slot_width, num_slots=self.pool.num_slots)

    def _make_comm(self, device: torch.device) -> TPComm:
        return TPComm(self.tp_size, use_list_gather=device.type != "cuda")

    @staticmethod
    def _rank0_config(config: EngineConfig, device: torch.device) -> EngineConfig:
        overrides = {"device": str(device)}
        if "cuda_graphs" in {f.name for f in dataclasses.fields(config)}:
            # A captured decode graph would replay rank 0's forward without the plan and the collectives.
            overrides["cuda_graphs"] = False
        # Followers take each step's tokens from rank 0's plan, which is built on the host: a step launched
        # ahead of its input tokens reaching the host cannot be planned.
        overrides["overlap_steps"] = False
        return dataclasses.replace(config, **overrides)

    def _start_followers(self, cfg, config, weights, backend, start_timeout_s, collective_timeout_s, log_level,
                         device) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one TPEngine with "
                               "tp_size > 1 per process (shut the other down first)")
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        if device.type == "cuda" and torch.cuda.device_count() < rank_device(config.device, self.tp_size - 1).index + 1:
            raise ValueError(f"tp={self.tp_size} from {config.device} needs {self.tp_size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        spec = {"model": model_config_to_dict(cfg), "weights": dict(weights), "engine": dataclasses.asdict(config),
                "backend": backend, "start_timeout_s": start_timeout_s,
                "collective_timeout_s": collective_timeout_s, "log_level": log_level}
        threads = max(1, (os.cpu_count() or 1) // self.tp_size) if device.type == "cpu" else None
        self.followers = FollowerGroup(self.tp_size, spec, cpu_threads=threads)

    def _join_process_group(self, device: torch.device, start_timeout_s: float, collective_timeout_s: float) -> None:
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=self.followers.store, rank=0,
                                world_size=self.tp_size, timeout=timedelta(seconds=collective_timeout_s))
        self._owns_process_group = True

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig, tp_size: int = 1, **kw) -> "TPEngine":
        # Absolute: the followers resolve it, and must find the same folder.
        return cls(ModelConfig.from_dir(model_dir), config, tp_size, {"model_dir": str(Path(model_dir).resolve())}, **kw)

    @classmethod
    def with_dummy_weights(cls, cfg: ModelConfig, config: EngineConfig, tp_size: int = 1, **kw) -> "TPEngine":
        return cls(cfg, config, tp_size, {"dummy_seed": config.seed}, **kw)

    # ---- adapters -------------------------------------------------------------------------------
    def _registered_adapter(self, name: str) -> PackedAdapter:
        return self._registered[name]

    def register_adapter(self, name: str, weights: LoraWeights) -> PackedAdapter:
        """In-process adapter source (tests, demo). Kept in single-GPU row format; every rank's share is cut
        from it when the adapter is loaded into the pool."""
        packed = pack_adapter(weights, self.full_cfg, self.full_cfg.kv_dim, torch.float32)
        packed.name = name
        self._registered[name] = packed
        return packed

    # ---- step -----------------------------------------------------------------------------------
    def launch_step(self):
        self.comm.traffic.reset()
        flight = super().launch_step()
        self.total_traffic.merge(self.comm.traffic)
        return flight

    @property
    def last_step_traffic(self) -> Traffic:
        """Collective traffic of the last step's forward (empty if it ran none)."""
        return self.comm.traffic

    @property
    def last_plan_bytes(self) -> int:
        """Control-channel bytes rank 0 sent for the last step plan (all followers together)."""
        return self.followers.plan_bytes if self.followers is not None else 0

    # ---- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_process_group = False

    def __enter__(self) -> "TPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
