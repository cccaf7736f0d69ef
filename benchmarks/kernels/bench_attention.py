"""Paged decode attention vs torch SDPA on contiguous KV of the same size, and one prefill point.

Bytes: the K and V rows every sequence's context must read (B x ctx x 2 x W x 2 bytes); the pool's slots
are a random permutation, as after a long run of allocations and frees. The batch is sized so one call
reads at least 256 MB (well past L2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.kernels.shapes import llama_config, paged_kv
from benchmarks.kernels.timing import time_graph
from services.gpu_worker import kernels
from services.gpu_worker.kernels.paged_attention import choose_attention_config


def _sdpa_inputs(kv, meta, cfg, q):
    """Contiguous [B, Hkv, ctx, hd] copies of the paged K/V (all sequences have one context length)."""
    b = meta.num_seqs
    ctx = meta.max_ctx_len
    slots = meta.slot_table[:, :ctx].long()
    k = kv[0][slots].view(b, ctx, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).contiguous()
    v = kv[1][slots].view(b, ctx, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).contiguous()
    return q.view(b, -1, cfg.num_heads, cfg.head_dim).transpose(1, 2), k, v


def bench_decode(model: str, contexts: list[int], dtype=torch.bfloat16, variants=None,
                 device: str = "cuda", min_bytes: int = 256 << 20) -> list[dict]:
    cfg = llama_config(model)
    per_token = 2 * cfg.kv_dim * torch.empty((), dtype=dtype).element_size()
    scale = cfg.head_dim ** -0.5
    rows = []
    for ctx in contexts:
        batch = min(256, max(2, -(-min_bytes // (ctx * per_token))))
        kv, meta = paged_kv(cfg, [1] * batch, [ctx] * batch, dtype, device)
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        nbytes = batch * ctx * per_token
        out = torch.empty_like(q)
        row = {"model": model, "batch": batch, "context": ctx, "kv_bytes": nbytes}
        row["ours_us"] = time_graph(lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out)) * 1e3
        default = choose_attention_config(meta, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                          q.device)
        row["config"] = repr(default)
        for name, config in (variants(default) if variants else {}).items():
            row[f"ours_{name}_us"] = time_graph(
                lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out, config=config)) * 1e3
        qs, k, v = _sdpa_inputs(kv, meta, cfg, q)
        gqa = cfg.num_heads != cfg.num_kv_heads
        try:
            row["sdpa_us"] = time_graph(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=gqa)) * 1e3
        except Exception as exc:  # record why a baseline could not run, keep the rest
            row["sdpa_error"] = repr(exc)[:200]
        ref = F.scaled_dot_product_attention(qs.float(), k.float(), v.float(), scale=scale, enable_gqa=gqa)
        got = kernels.attention(q, kv[0], kv[1], meta, scale)
        row["rel_err_vs_sdpa_fp32"] = float((got.float() - ref.transpose(1, 2).reshape_as(got)).norm() / ref.norm())
        row["ours_gbs"] = nbytes / row["ours_us"] / 1e3
        if "sdpa_us" in row:
            row["sdpa_gbs"] = nbytes / row["sdpa_us"] / 1e3
        rows.append(row)
        del kv, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_prefill(model: str, seqs: int = 4, length: int = 2048, dtype=torch.bfloat16, device: str = "cuda") -> dict:
    """Whole prompts (causal) as one prefill step vs SDPA is_causal on contiguous K/V; TFLOP/s counts the
    causal half of QKᵀ and PV."""
    cfg = llama_config(model)
    kv, meta = paged_kv(cfg, [length] * seqs, [length] * seqs, dtype, device)
    q = torch.randn(seqs * length, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    scale = cfg.head_dim ** -0.5
    out = torch.empty_like(q)
    ours = time_graph(lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out), iters=10)
    slots = meta.slot_table.long()
    k = kv[0][slots].view(seqs, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).contiguous()
    v = kv[1][slots].view(seqs, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).contiguous()
    qs = q.view(seqs, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    gqa = cfg.num_heads != cfg.num_kv_heads
    sdpa = time_graph(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa),
                      iters=10)
    flops = 2 * 2 * seqs * cfg.num_heads * cfg.head_dim * length * length / 2
    return {"model": model, "seqs": seqs, "length": length, "ours_us": ours * 1e3, "sdpa_us": sdpa * 1e3,
            "ours_tflops": flops / ours / 1e9, "sdpa_tflops": flops / sdpa / 1e9}
