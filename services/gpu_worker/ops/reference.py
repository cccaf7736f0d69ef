"""Torch reference ops on the unified pool. The CPU backend runs these; kernels are tested against them.

They are written for clarity and exactness, not speed: gathers through the slot tables into dense
tensors, then plain matmuls in the input dtype.
"""
from __future__ import annotations

import torch

from .meta import AttnMeta, LoraTables


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' K/V rows `[T, W]` at their slots."""
    idx = slots.long()
    k_buf[idx] = k.to(k_buf.dtype)
    v_buf[idx] = v.to(v_buf.dtype)


def attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Causal attention of new tokens over their paged context. q `[T, Hq, hd]` -> `[T, Hq, hd]`; GQA by
    repeating each KV head over its group of query heads."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1] // head_dim
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    q_start = meta.q_start.tolist()
    ctx_lens = meta.ctx_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        s, e = q_start[b], q_start[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        slots = meta.slot_table[b, :ctx].long()
        k = k_buf[slots].view(ctx, num_kv_heads, head_dim).to(q.dtype).repeat_interleave(group, dim=1)
        v = v_buf[slots].view(ctx, num_kv_heads, head_dim).to(q.dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k.float()) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


def _rows(buf: torch.Tensor, slot_list: torch.Tensor, start: int, rank: int, length: int) -> torch.Tensor:
    """Gather `rank` rows of `length` elements that begin at entry `start` of an adapter's slot list."""
    width = buf.shape[1]
    n_chunks = -(-length // width)
    ids = slot_list[start: start + rank * n_chunks].long()
    return buf[ids].reshape(rank, n_chunks * width)[:, :length]


def lora_shrink(x: torch.Tensor, k_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], max_rank: int, **launch_hints) -> torch.Tensor:
    """y[g, t, :r] = x[t] @ A_{g}ᵀ for the adapter of token t; zero beyond its rank and for base-only
    tokens. Returns `[len(modules), T, max_rank]` in x's dtype (accumulated in fp32). `launch_hints`
    (segment grouping for kernels) do not change the result and are ignored here."""
    num_tokens, fan_in = x.shape
    y = torch.zeros(len(modules), num_tokens, max_rank, dtype=x.dtype, device=x.device)
    for aid in torch.unique(token_adapter).tolist():
        if aid < 0:
            continue
        mask = token_adapter == aid
        for g, m in enumerate(modules):
            r = int(tables.ranks[aid, m])
            if r == 0:
                continue
            a = _rows(k_buf, tables.slots[aid], int(tables.a_off[aid, m]), r, fan_in)
            y[g, mask, :r] = (x[mask].float() @ a.float().t()).to(x.dtype)
    return y


def lora_expand(y: torch.Tensor, v_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], out: torch.Tensor, out_dims: tuple[int, ...], **launch_hints) -> None:
    """out[t, cols of module g] += y[g, t, :r] @ (scaled B_g)ᵀ, in place. `out` is `[T, sum(out_dims)]`,
    module g owning columns sum(out_dims[:g]) ... + out_dims[g] (fused q/k/v or gate/up outputs)."""
    col = 0
    col_start = []
    for d in out_dims:
        col_start.append(col)
        col += d
    for aid in torch.unique(token_adapter).tolist():
        if aid < 0:
            continue
        mask = token_adapter == aid
        for g, m in enumerate(modules):
            r = int(tables.ranks[aid, m])
            if r == 0:
                continue
            bt = _rows(v_buf, tables.slots[aid], int(tables.b_off[aid, m]), r, out_dims[g])
            c0 = col_start[g]
            delta = y[g, mask, :r].float() @ bt.float()
            out[mask, c0: c0 + out_dims[g]] += delta.to(out.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)`, the variance in fp32 as the Hugging Face Llama module computes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): the residual stream and the next sublayer's input."""
    summed = x + residual
    return summed, rms_norm(summed, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q `[T, Hq, hd]` and k `[T, Hkv, hd]`, non-interleaved halves."""
    c = cos[positions.long()].unsqueeze(1)
    s = sin[positions.long()].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    return rotate(q), rotate(k)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SwiGLU: silu(gate) * up from `[T, 2I]` gate-then-up columns."""
    gate, up = gate_up.split(intermediate, dim=-1)
    return torch.nn.functional.silu(gate) * up
