"""One rank's forward of the tensor-parallel Llama decoder, with S-LoRA tensor-parallel adapters.

Per layer:  x ──q/k/v (column)──> attention over this rank's heads ──o (row, partial)──> all-reduce
            x ──gate/up (column)──> silu·up ──down (row, partial)──> all-reduce
LoRA on column-parallel modules: shrink against this rank's A rows -> (T, r/N), all-gather -> (T, r), expand
against this rank's Bᵀ columns into this rank's output features. LoRA on row-parallel modules: shrink against
the A columns of this rank's input slice -> partial (T, r), all-reduce -> (T, r), expand against this rank's
Bᵀ hidden slice -> (T, h/N), added into this rank's columns of the base partial sum only: the base all-reduce
that follows sums the base partials and, since every other rank adds zeros there, delivers each rank's LoRA
slice to everyone in the same collective (the paper's fused all-gather).
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from ..model import DOWN, GATE_UP, O, QKV, ForwardBatch, LlamaModel
from ..ops.meta import LoraBatch, LoraTables
from ..pool import UnifiedPool
from ..weights import ModelWeights
from .comm import BASE_ALL_REDUCE, LORA_ALL_GATHER, LORA_ALL_REDUCE, TPComm
from .layout import COLUMN_INDEX, TPLayout, ceil_div


class TPLlamaModel(LlamaModel):
    def __init__(self, layout: TPLayout, rank: int, weights: ModelWeights, ops: ModuleType, max_positions: int,
                 comm: TPComm):
        super().__init__(layout.local_config(), weights, ops, max_positions)
        self.layout = layout
        self.rank = rank
        self.comm = comm
        self.full_cfg = layout.cfg
        self.hidden_cols = layout.hidden_cols(rank)
        self._column = torch.tensor(COLUMN_INDEX, dtype=torch.long, device=weights.embed.device)

    def shrink_tables(self, tables: LoraTables) -> LoraTables:
        """The tables with column-parallel modules at their per-rank A row count, ceil(r/N). Expand keeps the
        full ranks: after the all-gather every rank holds all r shrink outputs."""
        n = self.layout.size
        if n == 1:
            return tables
        ranks = tables.ranks.clone()
        ranks[:, self._column] = (ranks[:, self._column] + (n - 1)) // n
        return LoraTables(slots=tables.slots, ranks=ranks, a_off=tables.a_off, b_off=tables.b_off)

    def _column_lora(self, x: torch.Tensor, out: torch.Tensor, lora: LoraBatch, shrink: LoraTables,
                     pool: UnifiedPool, layer: int, modules: tuple[int, ...], out_dims: tuple[int, ...]) -> None:
        max_rank = lora.group_max_rank(modules)
        if max_rank == 0:
            return
        n = self.layout.size
        # Same width on every rank (from the plan's max ranks), as the all-gather requires.
        local = ceil_div(max_rank, n)
        hints = lora.kernel_args
        y = self.ops.lora_shrink(x, pool.k(layer), lora.token_adapter, shrink, modules, local, **hints)
        y = self.comm.all_gather(y, LORA_ALL_GATHER)  # [N, G, T, local]
        # Shrink output k came from rank k % N, local column k // N: interleave the ranks back.
        groups, tokens = y.shape[1], y.shape[2]
        y = y.permute(1, 2, 3, 0).reshape(groups, tokens, local * n)
        self.ops.lora_expand(y, pool.v(layer), lora.token_adapter, lora.tables, modules, out, out_dims, **hints)

    def _row_lora(self, x: torch.Tensor, out: torch.Tensor, lora: LoraBatch, pool: UnifiedPool, layer: int,
                  modules: tuple[int, ...]) -> None:
        max_rank = lora.group_max_rank(modules)
        if max_rank == 0:
            return
        hints = lora.kernel_args
        y = self.ops.lora_shrink(x, pool.k(layer), lora.token_adapter, lora.tables, modules, max_rank, **hints)
        self.comm.all_reduce(y, LORA_ALL_REDUCE)  # partial sums over input slices -> x·Aᵀ
        # Only this rank's hidden columns: the base all-reduce gathers the other slices.
        cols = out[:, self.hidden_cols]
        self.ops.lora_expand(y, pool.v(layer), lora.token_adapter, lora.tables, modules, cols,
                             (self.layout.hidden,), **hints)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor | None:
        """Logits `[N, vocab]` (fp32) on rank 0; None on the other ranks, which hold no lm_head."""
        cfg, ops, lora, comm, eps = self.cfg, self.ops, batch.lora, self.comm, self.cfg.rms_norm_eps
        num_tokens = batch.input_ids.shape[0]
        shrink = None
        if lora is not None:
            if hasattr(ops, "prepare_lora"):
                ops.prepare_lora(lora)  # per-step launch hints (tokens grouped by adapter), shared by all layers
            shrink = self.shrink_tables(lora.tables)
        layers = self.w.layers
        h = self.w.embed[batch.input_ids]
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, lw in enumerate(layers):
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            if lora is not None:
                self._column_lora(x, qkv, lora, shrink, pool, i, QKV, self.split)
            q, k, v = qkv.split(self.split, dim=-1)
            q, k = ops.rotary(q.view(num_tokens, cfg.num_heads, cfg.head_dim),
                              k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                              batch.positions, self.rotary.cos, self.rotary.sin)
            ops.write_kv(pool.k(i), pool.v(i), batch.out_slots, k.reshape(num_tokens, -1), v)
            attn = ops.attention(q, pool.k(i), pool.v(i), batch.attn, self.scale).reshape(num_tokens, -1)
            o = F.linear(attn, lw.o)
            if lora is not None:
                self._row_lora(attn, o, lora, pool, i, O)
            comm.all_reduce(o, BASE_ALL_REDUCE)
            h, x = ops.add_rms_norm(o, h, lw.post_norm, eps)
            gu = F.linear(x, lw.gate_up)
            if lora is not None:
                self._column_lora(x, gu, lora, shrink, pool, i, GATE_UP, (self.inter, self.inter))
            act = ops.silu_mul(gu, self.inter)
            d = F.linear(act, lw.down)
            if lora is not None:
                self._row_lora(act, d, lora, pool, i, DOWN)
            comm.all_reduce(d, BASE_ALL_REDUCE)
            if i + 1 < len(layers):
                h, x = ops.add_rms_norm(d, h, layers[i + 1].input_norm, eps)
        if self.w.lm_head is None:
            return None
        idx = batch.logits_index
        _, x = ops.add_rms_norm(d[idx], h[idx], self.w.final_norm, eps)
        return F.linear(x, self.w.lm_head).float()
