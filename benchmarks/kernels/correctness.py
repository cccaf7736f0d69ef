"""Kernels against the torch reference ops at Llama-2-7B and Llama-3-8B shapes (bf16 by default).

Each check draws fresh random inputs, poisons whole outputs with NaN first, and reports
‖out − ref‖ / ‖ref‖ (reference computed in fp32 from the same bf16 inputs).
"""
from __future__ import annotations

import torch

from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config, paged_kv
from services.gpu_worker import kernels
from services.gpu_worker.ops import reference

# Ranks 1, 7, 64 and 256 in one batch; adapter 4 is resident but unused.
CHECK_RANKS = [1, 7, 64, 256, 16, 32, 8]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _token_batches(num_adapters: int, device: str, gen: torch.Generator):
    """Decode-like (interleaved, base-only included) and prefill-like (runs) token -> adapter maps."""
    decode = torch.randint(-1, num_adapters, (37,), generator=gen, dtype=torch.int32)
    decode[:4] = torch.tensor([-1, 0, 1, 3], dtype=torch.int32)
    runs = [(3, 70), (1, 5), (-1, 9), (0, 130), (6, 3)]
    prefill = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in runs])
    starts = [0]
    for _, n in runs:
        starts.append(starts[-1] + n)
    seg = {"seg_start": torch.tensor(starts, dtype=torch.int32, device=device),
           "seg_adapter": torch.tensor([a for a, _ in runs], dtype=torch.int32, device=device),
           "max_seg_len": max(n for _, n in runs)}
    return decode.to(device), prefill.to(device), seg


def lora_checks(model: str, dtype: torch.dtype, device: str, seed: int = 0) -> list[dict]:
    cfg = llama_config(model)
    pool = AdapterPool(cfg, CHECK_RANKS, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    decode, prefill, seg = _token_batches(len(CHECK_RANKS), device, gen)
    rows = []
    for group, modules in GROUPS.items():
        fan_in, out_dims = cfg.group_dims(modules)
        for form in ("token", "grouped", "segments"):
            token_adapter = prefill if form == "segments" else decode
            kwargs = dict(seg) if form == "segments" else {}
            if form == "grouped":
                kwargs = kernels.group_tokens_by_adapter(token_adapter, len(CHECK_RANKS)).kwargs()
            num_tokens = token_adapter.shape[0]
            max_rank = max(CHECK_RANKS[a] for a in set(token_adapter.tolist()) if a >= 0)
            x = torch.randn(num_tokens, fan_in, generator=gen).to(device, dtype)
            ref_y = reference.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, max_rank)
            y = torch.full_like(ref_y, float("nan"))
            kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, max_rank, out=y, **kwargs)
            base = torch.randn(num_tokens, sum(out_dims), generator=gen).to(device, dtype)
            ref_out = base.clone()
            reference.lora_expand(ref_y, pool.v(), token_adapter, pool.tables, modules, ref_out, out_dims)
            out = base.clone()
            kernels.lora_expand(ref_y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, **kwargs)
            base_only = token_adapter < 0
            rows.append({"check": f"lora_shrink {group} {form}", "model": model, "tokens": num_tokens,
                         "rel_err": rel_err(y, ref_y), "zeros_exact": bool(torch.equal(y[:, base_only], ref_y[:, base_only]))})
            rows.append({"check": f"lora_expand {group} {form}", "model": model, "tokens": num_tokens,
                         "rel_err": rel_err(out - base, ref_out - base),
                         "zeros_exact": bool(torch.equal(out[base_only], base[base_only]))})
    return rows


def attention_checks(model: str, dtype: torch.dtype, device: str, seed: int = 0) -> list[dict]:
    cfg = llama_config(model)
    gen = torch.Generator().manual_seed(seed)
    scale = cfg.head_dim ** -0.5
    rows = []
    cases = {"decode": ([1] * 5, [1, 100, 513, 1024, 3000]),
             "prefill+extend": ([128, 1, 77, 300], [128, 600, 300, 300])}
    for name, (q_lens, ctx_lens) in cases.items():
        kv, meta = paged_kv(cfg, q_lens, ctx_lens, dtype, device, seed=seed)
        q = torch.randn(sum(q_lens), cfg.num_heads, cfg.head_dim, generator=gen).to(device, dtype)
        ref = reference.attention(q, kv[0], kv[1], meta, scale)
        out = torch.full_like(q, float("nan"))
        kernels.attention(q, kv[0], kv[1], meta, scale, out=out)
        rows.append({"check": f"attention {name}", "model": model, "tokens": sum(q_lens), "rel_err": rel_err(out, ref)})
    # write_kv: rows land bit-exact, other rows untouched.
    width = cfg.kv_dim
    k_buf = torch.full((300, width), float("nan"), dtype=dtype, device=device)
    v_buf = k_buf.clone()
    slots = torch.randperm(300, generator=gen)[:77].to(device=device, dtype=torch.int32)
    k = torch.randn(77, width, generator=gen).to(device, dtype)
    v = torch.randn(77, width, generator=gen).to(device, dtype)
    kernels.write_kv(k_buf, v_buf, slots, k, v)
    exact = torch.equal(k_buf[slots.long()], k) and torch.equal(v_buf[slots.long()], v)
    untouched = int(torch.isnan(k_buf).all(dim=1).sum()) == 300 - 77
    rows.append({"check": "write_kv", "model": model, "tokens": 77, "rel_err": 0.0 if exact else float("nan"),
                 "zeros_exact": untouched})
    return rows


def run_all(dtype: torch.dtype = torch.bfloat16, device: str = "cuda", tol: float = 1e-2, models=None) -> list[dict]:
    rows = []
    for model in models or ("llama2-7b", "llama3-8b"):
        rows += lora_checks(model, dtype, device)
        rows += attention_checks(model, dtype, device)
    for r in rows:
        r["ok"] = bool(r["rel_err"] < tol and r.get("zeros_exact", True))
    return rows
