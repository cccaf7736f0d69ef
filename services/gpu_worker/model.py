"""Llama-family decoder (Llama-2/3, Mistral, Qwen2) over the unified pool, with per-token LoRA.

One forward runs a ragged batch: prefill chunks and decode tokens of many requests, each request with its
own adapter (or none). Base GEMMs are shared by the whole batch; the LoRA terms go through the backend's
shrink/expand ops, which read adapter rows from pool slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from shared.model_config import ModelConfig

from .ops.meta import AttnMeta, LoraBatch
from .ops.stacked_lora import stacked_products
from .pool import UnifiedPool
from .rope import Rotary
from .weights import ModelWeights

QKV, O, GATE_UP, DOWN = (0, 1, 2), (3,), (4, 5), (6,)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int32 [T]
    out_slots: torch.Tensor  # int32 [T]: where each token's K/V goes
    attn: AttnMeta
    lora: LoraBatch | None
    logits_index: torch.Tensor  # int32 [N]: tokens whose next-token logits are wanted


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, ops: ModuleType, max_positions: int):
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        device, dtype = weights.embed.device, weights.embed.dtype
        self.rotary = Rotary(cfg, max_positions, device, dtype)
        self.scale = cfg.head_dim ** -0.5
        self.split = (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)
        self.inter = cfg.intermediate_size

    def _lora(self, x: torch.Tensor, out: torch.Tensor, lora: LoraBatch | None, pool: UnifiedPool,
              layer: int, modules: tuple[int, ...], out_dims: tuple[int, ...]) -> None:
        if lora is None:
            return
        max_rank = lora.group_max_rank(modules)
        if max_rank == 0:
            return
        if lora.stack_columns:
            a, bts = lora.stacks.operands(pool, layer, modules, lora.stack_columns, lora.stack_held)
            stacked_products(x, a, bts, lora.kernel_args["stack_keep"], out)
            return
        hints = lora.kernel_args
        y = self.ops.lora_shrink(x, pool.k(layer), lora.token_adapter, lora.tables, modules, max_rank, **hints)
        self.ops.lora_expand(y, pool.v(layer), lora.token_adapter, lora.tables, modules, out, out_dims, **hints)

    def prepare_lora(self, lora: LoraBatch) -> None:
        """A step's LoRA work shared by every layer: a stacked graph's column mask, or the backend's grouping of
        tokens by adapter."""
        if lora.stack_columns:
            # Which stacked columns each token keeps, once for every layer and group; no grouping by adapter.
            lora.kernel_args = {"stack_keep": lora.stacks.mask(lora.token_adapter, lora.stack_columns,
                                                               self.w.embed.dtype)}
        elif hasattr(self.ops, "prepare_lora"):
            self.ops.prepare_lora(lora)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[N, vocab]` (fp32) for the tokens in `batch.logits_index`, written into `logits_out` when given
        (the decode graphs' one output buffer: see cuda_graphs.py)."""
        cfg, ops, lora, eps = self.cfg, self.ops, batch.lora, self.cfg.rms_norm_eps
        num_tokens = batch.input_ids.shape[0]
        if lora is not None:
            self.prepare_lora(lora)
        layers = self.w.layers
        h = self.w.embed[batch.input_ids]
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, lw in enumerate(layers):
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            self._lora(x, qkv, lora, pool, i, QKV, self.split)
            q, k, v = qkv.split(self.split, dim=-1)
            q, k = ops.rotary(q.view(num_tokens, cfg.num_heads, cfg.head_dim),
                              k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                              batch.positions, self.rotary.cos, self.rotary.sin)
            ops.write_kv(pool.k(i), pool.v(i), batch.out_slots, k.reshape(num_tokens, -1), v)
            attn = ops.attention(q, pool.k(i), pool.v(i), batch.attn, self.scale).reshape(num_tokens, -1)
            o = F.linear(attn, lw.o)
            self._lora(attn, o, lora, pool, i, O, (cfg.hidden_size,))
            h, x = ops.add_rms_norm(o, h, lw.post_norm, eps)
            gu = F.linear(x, lw.gate_up)
            self._lora(x, gu, lora, pool, i, GATE_UP, (self.inter, self.inter))
            act = ops.silu_mul(gu, self.inter)
            d = F.linear(act, lw.down)
            self._lora(act, d, lora, pool, i, DOWN, (cfg.hidden_size,))
            if i + 1 < len(layers):
                h, x = ops.add_rms_norm(d, h, layers[i + 1].input_norm, eps)
        idx = batch.logits_index
        _, x = ops.add_rms_norm(d[idx], h[idx], self.w.final_norm, eps)
        logits = F.linear(x, self.w.lm_head)
        if logits_out is None:
            return logits.float()
        return logits_out.copy_(logits)  # the same cast as .float(), into a buffer that outlives this forward
