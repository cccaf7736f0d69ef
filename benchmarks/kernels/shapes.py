"""Llama-shaped pools for kernel checks and benchmarks: adapters of mixed ranks at scattered slots, and
paged KV of a batch of sequences. Data is random (never zeros: zeros hide unwritten outputs and can run
faster than real data)."""
from __future__ import annotations

import torch

from services.gpu_worker.adapter_layout import layout_offsets
from services.gpu_worker.ops.meta import AttnMeta, LoraTables
from shared.model_config import MODULES, ModelConfig


def llama_config(name: str) -> ModelConfig:
    if name == "llama2-7b":
        return ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                           num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128)
    if name == "llama3-8b":
        return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    if name == "tiny":  # CPU smoke runs of the benchmark scripts under the Triton interpreter
        return ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    raise ValueError(f"unknown shape {name!r}: llama2-7b, llama3-8b or tiny")


# Fused module groups of a Llama layer, as the engine launches them.
GROUPS = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}


class AdapterPool:
    """`num_layers` layers of K/V buffers holding adapters (every module adapted at the adapter's rank)
    at randomly permuted slots, plus `spare_slots` free slots; the resident tables for them."""

    def __init__(self, cfg: ModelConfig, ranks: list[int], dtype: torch.dtype, device: str, num_layers: int = 1,
                 spare_slots: int = 0, seed: int = 0):
        width = cfg.kv_dim
        gen = torch.Generator(device="cpu").manual_seed(seed)
        layouts = [layout_offsets((r,) * len(MODULES), cfg, width) for r in ranks]
        total = sum(n for _, _, n in layouts) + spare_slots
        self.num_slots = total
        self.width = width
        self.kv = torch.empty(num_layers, 2, total, width, dtype=dtype, device=device)
        self.kv.normal_(0.0, 0.02)
        perm = torch.randperm(total, generator=gen).to(torch.int32)
        max_slots = max(n for _, _, n in layouts)
        slots = torch.zeros(len(ranks), max_slots, dtype=torch.int32)
        rank_t = torch.zeros(len(ranks), len(MODULES), dtype=torch.int32)
        a_off = torch.zeros_like(rank_t)
        b_off = torch.zeros_like(rank_t)
        used = 0
        for i, (r, (ao, bo, n)) in enumerate(zip(ranks, layouts)):
            slots[i, :n] = perm[used: used + n]
            used += n
            rank_t[i] = r
            a_off[i] = torch.tensor(ao, dtype=torch.int32)
            b_off[i] = torch.tensor(bo, dtype=torch.int32)
        self.spare = perm[used:].to(device)
        self.tables = LoraTables(slots.to(device), rank_t.to(device), a_off.to(device), b_off.to(device))
        self.ranks = list(ranks)

    def k(self, layer: int = 0) -> torch.Tensor:
        return self.kv[layer, 0]

    def v(self, layer: int = 0) -> torch.Tensor:
        return self.kv[layer, 1]

    def adapter_bytes(self, token_adapter: torch.Tensor, fan_in: int, out_dims: tuple[int, ...]) -> int:
        """Bytes shrink + expand must read: each distinct adapter's A rows (fan_in per module) and Bᵀ rows."""
        elt = self.kv.element_size()
        distinct = [a for a in torch.unique(token_adapter).tolist() if a >= 0]
        return sum(self.ranks[a] * (fan_in * len(out_dims) + sum(out_dims)) * elt for a in distinct)


def paged_kv(cfg: ModelConfig, q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype, device: str,
             seed: int = 0, slot_run: int = 1, pool_slots: int = 0) -> tuple[torch.Tensor, AttnMeta]:
    """One layer's K/V `[2, slots, W]` with each sequence's context at randomly permuted slots: single slots, or
    runs of `slot_run` consecutive ones (each sequence starting a run), in a pool of at least `pool_slots`
    (a served pool spreads a layer's K/V over gigabytes, not over the batch's own few hundred megabytes). The
    pool is exactly `pool_slots` where that holds the contexts, so layouts of one served size compare as one:
    runs fill its whole runs, and a tail shorter than a run stays unused."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = sum(-(-n // slot_run) * slot_run for n in ctx_lens) + 16
    n_runs = max(-(-need // slot_run), pool_slots // slot_run)
    n_slots = max(n_runs * slot_run, pool_slots)
    kv = torch.empty(2, n_slots, cfg.kv_dim, dtype=dtype, device=device).normal_()
    runs = torch.randperm(n_runs, generator=gen)
    perm = (runs[:, None] * slot_run + torch.arange(slot_run)).reshape(-1).to(torch.int32)
    table = torch.zeros(len(ctx_lens), max(ctx_lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(ctx_lens):
        table[b, :n] = perm[used: used + n]
        used += -(-n // slot_run) * slot_run
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttnMeta(q_start=torch.tensor(starts, dtype=torch.int32, device=device),
                    ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
                    slot_table=table.to(device), max_q_len=max(q_lens), max_ctx_len=max(ctx_lens),
                    decode_only=all(n == 1 for n in q_lens))
    return kv, meta
