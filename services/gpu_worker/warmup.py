"""Throwaway requests run before a worker reports ready, so the first real ones do not pay for compiling.

On CUDA the first steps JIT-compile Triton kernels (a variant per specialization: a count of 1, a multiple of
16, anything else; prefill and decode; with and without LoRA; LoRA tiles for ranks up to 16 and above) and
capture decode graphs: seconds per step, in which the worker cannot send a heartbeat and the scheduler would
take it for dead, and which a running batch would wait through. Warm-up runs those shapes once: single and
batched requests, base-only and with a small (rank 8) and a wide (rank 64, or the largest allowed) adapter,
each alone and mixed, prompts short and past the attention split length, one admission round as large as a
step takes, and one admitted beside a busy batch's decodes, until all of them finish. (A rank-64 adapter's
first small batch took 1.5 s mid-traffic on an H200 when warm-up knew only rank 8.) The adapters are made here
and evicted afterwards; nothing is left in the pool.
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
WIDE_ADAPTER = "__warmup_wide__"
WIDE_RANK = 64  # the LoRA kernels tile ranks above 16 otherwise than ranks up to 16


def warmup_ranks(max_lora_rank: int) -> dict[str, int]:
    """The warm-up adapters by name: rank 8, and a wide one when the server accepts ranks above 16."""
    ranks = {WARMUP_ADAPTER: min(WARMUP_RANK, max_lora_rank)}
    if max_lora_rank > 16:
        ranks[WIDE_ADAPTER] = min(WIDE_RANK, max_lora_rank)
    return ranks


def warmup_adapter(cfg: ModelConfig, dtype: torch.dtype, rank: int = WARMUP_RANK,
                   name: str = WARMUP_ADAPTER) -> PackedAdapter:
    """An adapter of `rank` on every module, in the single-device row format the arena holds."""
    g = torch.Generator().manual_seed(rank)
    modules = {}
    for m in MODULES:
        fan_in, fan_out = cfg.module_dims(m)
        modules[m] = [LoraModuleWeights(torch.randn(rank, fan_in, generator=g) * 0.01,
                                        torch.randn(fan_out, rank, generator=g) * 0.01, 1.0)
                      for _ in range(cfg.num_layers)]
    return pack_adapter(LoraWeights(name, cfg.num_layers, modules), cfg, cfg.kv_dim, dtype)


def warmup_adapters(cfg: ModelConfig, dtype: torch.dtype, max_lora_rank: int) -> dict[str, PackedAdapter]:
    return {name: warmup_adapter(cfg, dtype, rank, name) for name, rank in warmup_ranks(max_lora_rank).items()}


class WithWarmupAdapter:
    """The worker's adapter loader, answering for the warm-up adapters itself."""

    def __init__(self, loader, packed: dict[str, PackedAdapter]):
        self.loader = loader
        self.packed = packed

    def __call__(self, name: str) -> PackedAdapter:
        return self.packed[name] if name in self.packed else self.loader(name)

    def ready(self, name: str) -> bool:
        return name in self.packed or adapter_ready(self.loader, name)


def warmup_requests(cfg: ModelConfig, max_model_len: int, num_slots: int, max_running: int,
                    adapters: list[str] | None = None) -> list[EngineRequest]:
    """Every other request on an adapter, the adapters taking turns."""
    adapters = adapters or [WARMUP_ADAPTER]
    vocab = cfg.vocab_size
    long_prompt = min(600, max_model_len - 8, num_slots // 4)
    lengths = [1, 5, 17, 32] + list(range(2, 16)) + ([long_prompt] if long_prompt > 32 else [])
    out = []
    for i, n in enumerate(lengths[:max(1, max_running)]):
        prompt = [(7 * i + 13 * j) % vocab for j in range(n)]
        sampling = SamplingParams(max_tokens=2 + i % 4, ignore_eos=True)
        adapter = adapters[(i // 2) % len(adapters)] if i % 2 else None
        out.append(EngineRequest(f"warmup-{i}", prompt, sampling, adapter=adapter))
    return out


def warmup_round(cfg: ModelConfig, max_model_len: int, num_slots: int, requests: int, tokens: int,
                 adapters: list[str], prefix: str = "warmup-round") -> list[EngineRequest]:
    """One round of `requests` prompts filling a step's `tokens` (within a quarter of the pool), a third
    base-only and the rest over the adapters: the shape of an admission step under load."""
    requests = max(1, requests)
    length = max(1, min(min(tokens, num_slots // 4) // requests, max_model_len - 8))
    out = []
    for i in range(requests):
        prompt = [(11 * i + 5 * j) % cfg.vocab_size for j in range(length)]
        adapter = None if i % 3 == 0 else adapters[i % len(adapters)]
        out.append(EngineRequest(f"{prefix}-{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), adapter))
    return out


def warmup_decodes(cfg: ModelConfig, requests: int, adapters: list[str]) -> list[EngineRequest]:
    """A busy batch of short requests, over the adapters and base-only, decoding while a round is admitted
    beside them: under load an admission step carries every running request's decode token with the round's
    prompts, and its LoRA launches (chunked segments among the decode tokens' short ones) are tiled otherwise
    than a round's alone. On an H100, after a warm-up without this batch, the engine met 6 such expand variants
    in 20 s of S-GQA traffic; with it, warm-up built 2 more and traffic met 5 and 1 in two runs (how a run's
    admission steps fall decides which it meets; docs/benchmarks.md, 2026-12-06 18:37)."""
    out = []
    for i in range(max(0, requests)):
        prompt = [(3 * i + 7 * j) % cfg.vocab_size for j in range(4)]
        adapter = adapters[i % len(adapters)] if i % (len(adapters) + 1) else None
        out.append(EngineRequest(f"warmup-decode-{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True), adapter))
    return out


def warm_up(engine, cfg: ModelConfig, timeout_s: float = 600.0, adapters: list[str] | None = None) -> float:
    """Run the warm-up requests to completion (one alone, one on each adapter alone, the rest together, an
    admission round, then a round beside a busy batch); returns seconds."""
    started = time.monotonic()
    adapters = adapters or [WARMUP_ADAPTER]
    config = engine.config
    requests = warmup_requests(cfg, engine.max_model_len, engine.pool.num_slots, config.max_running_requests,
                               adapters)
    # The first request on each adapter runs alone, then all mix: a step's LoRA tiles follow its widest
    # adapter, so each alone and the mix are different kernels.
    first_on: dict[str, EngineRequest] = {}
    for r in requests:
        if r.adapter is not None:
            first_on.setdefault(r.adapter, r)
    alone = list(first_on.values())
    alone_ids = {r.request_id for r in alone}
    rest = [r for r in requests[1:] if r.request_id not in alone_ids]
    round_size = engine.admission_round
    decodes = max(0, config.max_running_requests - round_size)
    mixed_tokens = max(round_size, config.max_batched_tokens - decodes)

    def round_(tokens: int, prefix: str) -> list[EngineRequest]:
        return warmup_round(cfg, engine.max_model_len, engine.pool.num_slots, round_size, tokens, adapters, prefix)

    # (batch, a round added once the batch is running): the last is the busy batch with a round beside it.
    batches = [(requests[:1], []), *(([r], []) for r in alone), (rest, []),
               (round_(config.max_batched_tokens, "warmup-round"), []),
               (warmup_decodes(cfg, decodes, adapters), round_(mixed_tokens, "warmup-mixed"))]

    def step_all() -> None:
        for out in engine.step():
            if out.finish_reason == "error":
                log.warning("worker.warmup_request_failed", request_id=out.request_id, error=out.error)
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"warm-up did not finish within {timeout_s:g}s")

    for batch, beside in batches:
        for req in batch:
            engine.add_request(req)
        while beside and engine.waiting:
            step_all()
        for req in beside:
            engine.add_request(req)
        while engine.has_unfinished():
            step_all()
    for name in adapters:
        engine.adapters.evict(name)
    graphs = capture_graphs(engine)
    seconds = time.monotonic() - started
    log.info("worker.warmed_up", seconds=round(seconds, 2), requests=sum(len(b) + len(r) for b, r in batches),
             adapters=len(adapters), graphs=graphs, **gpu_memory(engine.device))
    return seconds


def gpu_memory(device) -> dict[str, float]:
    """GB of the GPU free and held by this process once the pool, the weights and the graphs are in place:
    what traffic's steps have left (an 80 GB card once ran out during serving; docs/benchmarks.md,
    2026-12-05 16:43). Empty off CUDA."""
    if getattr(device, "type", device) != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"gpu_free_gb": round(free / 2**30, 2), "gpu_total_gb": round(total / 2**30, 2),
            "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / 2**30, 2),
            "gpu_reserved_gb": round(torch.cuda.memory_reserved(device) / 2**30, 2)}


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
