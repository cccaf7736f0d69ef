"""Throwaway requests run before a worker reports ready, so the first real ones do not pay for compiling.

On CUDA the first steps JIT-compile Triton kernels (a variant per specialization: a count of 1, a multiple of
16, anything else; prefill and decode; with and without LoRA) and capture decode graphs: seconds per step, in
which the worker cannot send a heartbeat and the scheduler would take it for dead. Warm-up runs those shapes
once: single and batched requests, base-only and with a small adapter, prompts short and past the attention
split length, until all of them finish. The adapter is made here and evicted afterwards; nothing is left
in the pool.
"""
from __future__ import annotations

import time

import torch

from shared.log import get_logger
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import MODULES, ModelConfig

from .adapter_layout import PackedAdapter, pack_adapter
from .requests import EngineRequest
from .resident_adapters import adapter_ready
from .sampling import SamplingParams

log = get_logger(__name__)

WARMUP_ADAPTER = "__warmup__"
WARMUP_RANK = 8


def warmup_adapter(cfg: ModelConfig, dtype: torch.dtype) -> PackedAdapter:
    """A rank-8 adapter on every module, in the single-device row format the arena holds."""
    g = torch.Generator().manual_seed(0)
    modules = {}
    for m in MODULES:
        fan_in, fan_out = cfg.module_dims(m)
        modules[m] = [LoraModuleWeights(torch.randn(WARMUP_RANK, fan_in, generator=g) * 0.01,
                                        torch.randn(fan_out, WARMUP_RANK, generator=g) * 0.01, 1.0)
                      for _ in range(cfg.num_layers)]
    return pack_adapter(LoraWeights(WARMUP_ADAPTER, cfg.num_layers, modules), cfg, cfg.kv_dim, dtype)


class WithWarmupAdapter:
    """The worker's adapter loader, answering for the warm-up adapter itself."""

    def __init__(self, loader, packed: PackedAdapter):
        self.loader = loader
        self.packed = packed

    def __call__(self, name: str) -> PackedAdapter:
        return self.packed if name == WARMUP_ADAPTER else self.loader(name)

    def ready(self, name: str) -> bool:
        return name == WARMUP_ADAPTER or adapter_ready(self.loader, name)


def warmup_requests(cfg: ModelConfig, max_model_len: int, num_slots: int, max_running: int) -> list[EngineRequest]:
    vocab = cfg.vocab_size
    long_prompt = min(600, max_model_len - 8, num_slots // 4)
    lengths = [1, 5, 17, 32] + list(range(2, 16)) + ([long_prompt] if long_prompt > 32 else [])
    out = []
    for i, n in enumerate(lengths[:max(1, max_running)]):
        prompt = [(7 * i + 13 * j) % vocab for j in range(n)]
        sampling = SamplingParams(max_tokens=2 + i % 4, ignore_eos=True)
        out.append(EngineRequest(f"warmup-{i}", prompt, sampling, adapter=WARMUP_ADAPTER if i % 2 else None))
    return out


def warm_up(engine, cfg: ModelConfig, timeout_s: float = 600.0) -> float:
    """Run the warm-up requests to completion (first one alone, then the rest together); returns seconds."""
    started = time.monotonic()
    requests = warmup_requests(cfg, engine.max_model_len, engine.pool.num_slots, engine.config.max_running_requests)
    for batch in (requests[:1], requests[1:2], requests[2:]):
        for req in batch:
            engine.add_request(req)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finish_reason == "error":
                    log.warning("worker.warmup_request_failed", request_id=out.request_id, error=out.error)
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"warm-up did not finish within {timeout_s:g}s")
    engine.adapters.evict(WARMUP_ADAPTER)
    graphs = capture_graphs(engine)
    seconds = time.monotonic() - started
    log.info("worker.warmed_up", seconds=round(seconds, 2), requests=len(requests), graphs=graphs)
    return seconds


def capture_graphs(engine) -> int:
    """How many decode graphs are captured ahead of traffic, within the engine's cuda_graph_warmup_s. A
    capture that fails (e.g. out of memory) ends this early and is logged; the rest are captured on first use."""
    graphs = getattr(engine, "graphs", None)
    config = engine.config
    if graphs is None or config.cuda_graph_warmup_s <= 0:
        return 0
    max_context = min(config.cuda_graph_max_context or engine.max_model_len, engine.max_model_len)
    started = time.monotonic()
    try:
        graphs.capture_all(max_context, deadline=started + config.cuda_graph_warmup_s)
    except Exception as e:  # noqa: BLE001 (out of memory, say: an optimisation failing must not stop the worker)
        log.warning("worker.graph_capture_stopped", error=str(e)[:300], captured=len(graphs.graphs))
        return len(graphs.graphs)
    log.info("worker.graphs_captured", graphs=len(graphs.graphs), seconds=round(time.monotonic() - started, 2),
             max_context=max_context)
    return len(graphs.graphs)
