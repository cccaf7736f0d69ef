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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32, as the HF implementation does, so fp16/bf16 match the reference closely.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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
        hints = lora.kernel_args
        y = self.ops.lora_shrink(x, pool.k(layer), lora.token_adapter, lora.tables, modules, max_rank, **hints)
        self.ops.lora_expand(y, pool.v(layer), lora.token_adapter, lora.tables, modules, out, out_dims, **hints)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        """Logits `[N, vocab]` (fp32) for the tokens in `batch.logits_index`."""
        cfg, ops, lora = self.cfg, self.ops, batch.lora
        num_tokens = batch.input_ids.shape[0]
        if lora is not None and hasattr(ops, "prepare_lora"):
            ops.prepare_lora(lora)
        h = self.w.embed[batch.input_ids]
        for i, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            self._lora(x, qkv, lora, pool, i, QKV, self.split)
            q, k, v = qkv.split(self.split, dim=-1)
            q = self.rotary.apply(q.view(num_tokens, cfg.num_heads, cfg.head_dim), batch.positions)
            k = self.rotary.apply(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), batch.positions)
            ops.write_kv(pool.k(i), pool.v(i), batch.out_slots, k.reshape(num_tokens, -1), v)
            attn = ops.attention(q, pool.k(i), pool.v(i), batch.attn, self.scale).reshape(num_tokens, -1)
            o = F.linear(attn, lw.o)
            self._lora(attn, o, lora, pool, i, O, (cfg.hidden_size,))
            h = h + o
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            gu = F.linear(x, lw.gate_up)
            self._lora(x, gu, lora, pool, i, GATE_UP, (self.inter, self.inter))
            gate, up = gu.split(self.inter, dim=-1)
            act = F.silu(gate) * up
            d = F.linear(act, lw.down)
            self._lora(act, d, lora, pool, i, DOWN, (cfg.hidden_size,))
            h = h + d
        h = rms_norm(h[batch.logits_index], self.w.final_norm, cfg.rms_norm_eps)
        return F.linear(h, self.w.lm_head).float()
