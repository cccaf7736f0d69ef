"""Paged decode attention vs torch SDPA on contiguous KV of the same size, a served decode batch of mixed
contexts, and one prefill point.

Bytes: the K and V rows every sequence's context must read (B x ctx x 2 x W x 2 bytes); the pool's slots
are a random permutation, as after a long run of allocations and frees. The batch is sized so one call
reads at least 256 MB (well past L2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.kernels.shapes import llama_config, paged_kv
from benchmarks.kernels.timing import time_graph
from services.gpu_worker import kernels
from services.gpu_worker.kernels.launch_shapes import launch_shapes, set_launch_shapes
from services.gpu_worker.kernels.paged_attention import choose_attention_config
from shared.kernel_shapes import LaunchShapes


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


def served_contexts(batch: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int = 0) -> list[int]:
    """Contexts of a served decode batch: each sequence's prompt plus the part of its output made so far, prompt
    and output lengths uniform in their ranges (the S1/S2/S-GQA workloads), as a running batch holds them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_range[0], prompt_range[1] + 1, (batch,), generator=gen)
    outputs = torch.randint(output_range[0], output_range[1] + 1, (batch,), generator=gen)
    made = (torch.rand(batch, generator=gen) * outputs).long()
    return (prompts + made + 1).tolist()


def chosen_under(shapes: str, meta, cfg) -> "AttentionConfig":
    """The launch shape the launcher chooses for `meta` while the worker setting kernel_shapes is `shapes`."""
    before = launch_shapes()
    set_launch_shapes(LaunchShapes.parse(shapes))
    try:
        return choose_attention_config(meta, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                       meta.ctx_lens.device)
    finally:
        set_launch_shapes(before)


def bench_decode_served(model: str, batches: list[int], dtype=torch.bfloat16, shapes: tuple[str, ...] = (),
                        device: str = "cuda", prompt_range: tuple[int, int] = (8, 512),
                        output_range: tuple[int, int] = (8, 512),
                        layouts: tuple[tuple[int, int], ...] = ((1, 0),)) -> list[dict]:
    """One decode step's attention as the engine runs it while serving: `batch` sequences of mixed contexts
    (served_contexts), one launch with the chosen config and one under each of `shapes` (worker.kernel_shapes
    values: a winner is served as it is named). `layouts`: (slot_run, pool_slots) pairs for paged_kv:
    single-token pages at random (the pool's own allocation, each decode step handing the batch's sequences
    consecutive slots) or runs of consecutive slots, in a pool as large as a served one or just the batch's.
    No SDPA column: contiguous K/V of equal lengths is not this shape."""
    cfg = llama_config(model)
    per_token = 2 * cfg.kv_dim * torch.empty((), dtype=dtype).element_size()
    scale = cfg.head_dim ** -0.5
    rows = []
    for batch in batches:
        ctx = served_contexts(batch, prompt_range, output_range)
        for slot_run, pool_slots in layouts:
            kv, meta = paged_kv(cfg, [1] * batch, ctx, dtype, device, slot_run=slot_run, pool_slots=pool_slots)
            q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
            out = torch.empty_like(q)
            nbytes = sum(ctx) * per_token
            row = {"model": model, "batch": batch, "context_mean": sum(ctx) / batch, "context_max": max(ctx),
                   "slot_run": slot_run, "pool_slots": kv.shape[1], "kv_bytes": nbytes,
                   "config": repr(chosen_under("", meta, cfg))}
            row["ours_us"] = time_graph(lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out)) * 1e3
            want = kernels.attention(q, kv[0], kv[1], meta, scale)
            for words in shapes:
                config = chosen_under(words, meta, cfg)
                got = kernels.attention(q, kv[0], kv[1], meta, scale, config=config)
                # A shape only changes the launch: its output must be the default's up to summation order.
                row[f"ours_{words}_max_diff"] = float((got.float() - want.float()).abs().max())
                row[f"ours_{words}_us"] = time_graph(
                    lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out, config=config)) * 1e3
            row["ours_gbs"] = nbytes / row["ours_us"] / 1e3
            rows.append(row)
            del kv
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_mixed(model: str, running: int, prompts: int, dtype=torch.bfloat16, device: str = "cuda",
                prompt_range: tuple[int, int] = (8, 512), output_range: tuple[int, int] = (8, 512),
                seed: int = 0) -> dict:
    """An admission step's attention: `running` decode rows (served_contexts) first, then `prompts` whole
    prompts, as one launch and as two (decode rows apart, kernels.attention's split_decode); bytes are the
    decode rows' K/V, which dominate."""
    cfg = llama_config(model)
    per_token = 2 * cfg.kv_dim * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed + 1)
    ctx = served_contexts(running, prompt_range, output_range, seed)
    lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (prompts,), generator=gen).tolist()
    kv, meta = paged_kv(cfg, [1] * running + lengths, ctx + lengths, dtype, device, seed)
    meta.decode_seqs, meta.decode_max_ctx = running, max(ctx)
    q = torch.randn(running + sum(lengths), cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    scale = cfg.head_dim ** -0.5
    out = torch.empty_like(q)
    one = kernels.attention(q, kv[0], kv[1], meta, scale, split_decode=False)
    two = kernels.attention(q, kv[0], kv[1], meta, scale, split_decode=True)
    row = {"model": model, "running": running, "prompts": prompts, "prompt_tokens": sum(lengths),
           "context_mean": sum(ctx) / running, "decode_kv_bytes": sum(ctx) * per_token,
           "max_diff_apart_vs_one": float((one.float() - two.float()).abs().max())}
    for name, apart in (("one_launch", False), ("decode_apart", True)):
        row[f"{name}_us"] = time_graph(
            lambda: kernels.attention(q, kv[0], kv[1], meta, scale, out=out, split_decode=apart)) * 1e3
    row["decode_apart_gbs"] = row["decode_kv_bytes"] / row["decode_apart_us"] / 1e3
    row["one_launch_gbs"] = row["decode_kv_bytes"] / row["one_launch_us"] / 1e3
    return row


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
