"""LoRA shrink + expand on the paged pool vs padded torch.bmm vs gather-then-bmm, decode batches 1..512.

Setting: one fused group (q,k,v or gate,up) of a Llama-2-7B layer, `n_adapters` resident adapters with
ranks cycling over {8, 16, 32, 64}, each token's adapter drawn uniformly. Ours reads each distinct
adapter's rows at their real rank; the baselines use per-token weight stacks padded to the batch's max
rank (the S-LoRA/Punica bmm baselines): "bmm" times the bmm calls alone on stacks gathered beforehand,
"gather+bmm" also gathers the stacks from the pool each call. GB/s counts the adapter bytes shrink and
expand must read (distinct adapters x rank x (fan_in x modules + sum of out dims) x 2 bytes).

Each method is captured in a CUDA graph that cycles over several layers' buffers, so repeated replays
stream from HBM rather than L2; times are per layer call.
"""
from __future__ import annotations

import torch

from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config
from benchmarks.kernels.timing import time_graph
from services.gpu_worker import kernels
from services.gpu_worker.kernels.checks import cdiv

L2_BYTES = 60 << 20


def _gather_index(pool: AdapterPool, token_adapter: torch.Tensor, modules, length: int, first_col: str,
                  pad_rank: int, zero_slot: int) -> torch.Tensor:
    """Slot ids of per-token padded rows: [T, len(modules) * pad_rank, n_chunks]; rows past an adapter's
    rank (and base-only tokens) point at an all-zero slot."""
    tables = pool.tables
    nc = cdiv(length, pool.width)
    ta = token_adapter.long()
    safe = ta.clamp_min(0)
    i = torch.arange(pad_rank, device=ta.device)
    c = torch.arange(nc, device=ta.device)
    parts = []
    for m in modules:
        rank = torch.where(ta >= 0, tables.ranks[safe, m].long(), 0)
        first = getattr(tables, first_col)[safe, m].long()
        entry = first[:, None, None] + i[None, :, None] * nc + c[None, None, :]
        entry = entry.clamp_max(tables.slots.shape[1] - 1)
        slot = torch.gather(tables.slots[safe].long(), 1, entry.view(len(ta), -1)).view(len(ta), pad_rank, nc)
        parts.append(torch.where((i[None, :] < rank[:, None])[:, :, None], slot, zero_slot))
    return torch.stack(parts, 1).view(len(ta), len(modules) * pad_rank, nc)


def bench_group(model: str, group: str, batches: list[int], n_adapters: int = 100, num_layers: int = 8,
                rank_set=(8, 16, 32, 64), dtype=torch.bfloat16, seed: int = 0,
                device: str = "cuda") -> list[dict]:
    cfg = llama_config(model)
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    ranks = [rank_set[i % len(rank_set)] for i in range(n_adapters)]
    pool = AdapterPool(cfg, ranks, dtype, device, num_layers=num_layers, spare_slots=1, seed=seed)
    zero_slot = int(pool.spare[0])
    pool.kv[:, :, zero_slot].zero_()
    gen = torch.Generator().manual_seed(seed)
    width = pool.width
    cols = [sum(out_dims[:g]) for g in range(len(out_dims))]
    rows = []
    for num_tokens in batches:
        token_adapter = torch.randint(0, n_adapters, (num_tokens,), generator=gen, dtype=torch.int32).to(device)
        used = torch.unique(token_adapter).tolist()
        max_rank = max(ranks[a] for a in used)
        x = torch.randn(num_tokens, fan_in, generator=gen).to(device, dtype)
        out = torch.randn(num_tokens, sum(out_dims), generator=gen).to(device, dtype)
        nbytes = pool.adapter_bytes(token_adapter, fan_in, out_dims)
        # As in a serving worker's decode graph: its resident table (4096 rows) is larger than any batch, so the
        # kernels get one segment slot per token, however few adapters the batch holds.
        groups = kernels.group_tokens_by_adapter(token_adapter)
        ys = {}

        def ours(form: str, part: str = "both"):
            kwargs = groups.kwargs() if form == "grouped" else {}

            def run():
                for layer in range(num_layers):
                    if part != "expand":
                        ys[form] = kernels.lora_shrink(x, pool.k(layer), token_adapter, pool.tables, modules,
                                                       max_rank, **kwargs)
                    if part != "shrink":
                        kernels.lora_expand(ys[form], pool.v(layer), token_adapter, pool.tables, modules, out,
                                            out_dims, **kwargs)
            return run

        row = {"model": model, "group": group, "batch": num_tokens, "distinct_adapters": len(used),
               "max_rank": max_rank, "adapter_bytes": nbytes}
        for form in ("token", "grouped"):
            ms = time_graph(ours(form)) / num_layers
            row[f"ours_{form}_us"] = ms * 1e3
            row[f"ours_{form}_shrink_us"] = time_graph(ours(form, "shrink")) / num_layers * 1e3
            row[f"ours_{form}_expand_us"] = time_graph(ours(form, "expand")) / num_layers * 1e3
        row["grouping_us"] = time_graph(lambda: kernels.group_tokens_by_adapter(token_adapter)) * 1e3

        # Baselines: per-token stacks padded to max_rank; enough layers rotated to exceed L2.
        idx_a = _gather_index(pool, token_adapter, modules, fan_in, "a_off", max_rank, zero_slot)
        idx_b = [_gather_index(pool, token_adapter, (m,), d, "b_off", max_rank, zero_slot)
                 for m, d in zip(modules, out_dims)]
        padded_bytes = max_rank * (fan_in * len(modules) + sum(out_dims)) * num_tokens * pool.kv.element_size()
        b_layers = max(1, min(num_layers, cdiv(4 * L2_BYTES, padded_bytes)))

        def gather(layer):
            a = pool.k(layer)[idx_a].view(num_tokens, len(modules) * max_rank, -1)[:, :, :fan_in]
            bs = [pool.v(layer)[ib].view(num_tokens, max_rank, -1)[:, :, :d] for ib, d in zip(idx_b, out_dims)]
            return a, bs

        def bmm_step(a, bs):
            y = torch.bmm(x[:, None, :], a.transpose(1, 2))
            for g, (b, d) in enumerate(zip(bs, out_dims)):
                out[:, cols[g]: cols[g] + d] += torch.bmm(y[:, :, g * max_rank: (g + 1) * max_rank], b)[:, 0]

        stacks = [gather(layer) for layer in range(b_layers)]
        stacks = [(a.contiguous(), [b.contiguous() for b in bs]) for a, bs in stacks]

        def padded():
            for a, bs in stacks:
                bmm_step(a, bs)

        def gather_bmm():
            for layer in range(b_layers):
                bmm_step(*gather(layer))

        row["bmm_us"] = time_graph(padded) / b_layers * 1e3
        del stacks
        row["gather_bmm_us"] = time_graph(gather_bmm) / b_layers * 1e3
        row["padded_bytes"] = padded_bytes
        best = min(row["ours_token_us"], row["ours_grouped_us"])
        row["ours_best_us"] = best
        row["ours_best_form"] = "token" if best == row["ours_token_us"] else "grouped"
        row["ours_gbs"] = nbytes / best / 1e3
        row["speedup_vs_bmm"] = row["bmm_us"] / best
        row["speedup_vs_gather_bmm"] = row["gather_bmm_us"] / best
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def check_baselines_agree(model: str = "llama2-7b", group: str = "qkv", num_tokens: int = 48, seed: int = 1,
                          dtype=torch.bfloat16, device: str = "cuda") -> float:
    """The bmm baseline computes the same function as ours (so the comparison is like for like):
    relative difference of the expand outputs."""
    cfg = llama_config(model)
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(20)]
    pool = AdapterPool(cfg, ranks, dtype, device, spare_slots=1, seed=seed)
    zero_slot = int(pool.spare[0])
    pool.kv[:, :, zero_slot].zero_()
    gen = torch.Generator().manual_seed(seed)
    token_adapter = torch.randint(-1, 20, (num_tokens,), generator=gen, dtype=torch.int32).to(device)
    max_rank = 64
    x = torch.randn(num_tokens, fan_in, generator=gen).to(device, dtype)
    base = torch.randn(num_tokens, sum(out_dims), generator=gen).to(device, dtype)
    out = base.clone()
    y = kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, max_rank)
    kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims)
    idx_a = _gather_index(pool, token_adapter, modules, fan_in, "a_off", max_rank, zero_slot)
    a = pool.k()[idx_a].view(num_tokens, len(modules) * max_rank, -1)[:, :, :fan_in]
    yb = torch.bmm(x[:, None, :], a.transpose(1, 2))
    ref = base.clone()
    col = 0
    for g, (m, d) in enumerate(zip(modules, out_dims)):
        ib = _gather_index(pool, token_adapter, (m,), d, "b_off", max_rank, zero_slot)
        b = pool.v()[ib].view(num_tokens, max_rank, -1)[:, :, :d]
        ref[:, col: col + d] += torch.bmm(yb[:, :, g * max_rank: (g + 1) * max_rank], b)[:, 0]
        col += d
    return float((out - base).double().sub((ref - base).double()).norm() / (ref - base).double().norm())


def sweep_launch_shapes(model: str, group: str, num_tokens: int, n_adapters: int = 100, num_layers: int = 8,
                        rank_set=(8, 16, 32, 64), dtype=torch.bfloat16, seed: int = 0,
                        device: str = "cuda") -> list[dict]:
    """Shrink alone and expand alone under launch shapes around the default, per form: data for choosing
    the defaults, and for saying where time goes when a target is missed."""
    from dataclasses import replace

    from services.gpu_worker.kernels.lora_expand import choose_expand_config
    from services.gpu_worker.kernels.lora_shrink import choose_shrink_config

    cfg = llama_config(model)
    modules = GROUPS[group]
    fan_in, out_dims = cfg.group_dims(modules)
    ranks = [rank_set[i % len(rank_set)] for i in range(n_adapters)]
    pool = AdapterPool(cfg, ranks, dtype, device, num_layers=num_layers, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    token_adapter = torch.randint(0, n_adapters, (num_tokens,), generator=gen, dtype=torch.int32).to(device)
    max_rank = max(ranks[a] for a in torch.unique(token_adapter).tolist())
    x = torch.randn(num_tokens, fan_in, generator=gen).to(device, dtype)
    out = torch.randn(num_tokens, sum(out_dims), generator=gen).to(device, dtype)
    groups = kernels.group_tokens_by_adapter(token_adapter)  # one segment slot per token, as in bench_group
    nbytes = pool.adapter_bytes(token_adapter, fan_in, out_dims)
    shrink_bytes = nbytes * fan_in * len(out_dims) // (fan_in * len(out_dims) + sum(out_dims))
    expand_bytes = nbytes - shrink_bytes
    dev = torch.device(device)
    rows = []
    for form in ("token", "grouped"):
        seg = form == "grouped"
        kwargs = groups.kwargs() if seg else {}
        n_seg = groups.seg_adapter.shape[0] if seg else None
        s0 = choose_shrink_config(num_tokens, len(modules), fan_in, pool.width, max_rank, dev, seg, None, n_seg)
        e0 = choose_expand_config(num_tokens, len(modules), out_dims, pool.width, max_rank, dev, seg, None, n_seg)
        shrink_variants = {"default": s0, "block_r 16": replace(s0, block_r=16),
                           "block_r 64": replace(s0, block_r=64),
                           "split x2": replace(s0, n_split=s0.n_split * 2),
                           "split /2": replace(s0, n_split=max(1, s0.n_split // 2)),
                           "block_k 256": replace(s0, block_k=256), "warps 2": replace(s0, num_warps=2),
                           "stages 2": replace(s0, num_stages=2), "stages 3": replace(s0, num_stages=3)}
        expand_variants = {"default": e0, "tiles 2": replace(e0, tiles_per_prog=2),
                           "tiles 4": replace(e0, tiles_per_prog=4),
                           "block_r 16": replace(e0, block_r=16), "block_r 32": replace(e0, block_r=32),
                           "block_n 64": replace(e0, block_n=64), "block_n 256": replace(e0, block_n=256),
                           # Wider tiles: each program streams longer runs of a Bᵀ row per slot (512 columns:
                           # 1 KB) behind the same chain of dependent loads.
                           "block_n 512": replace(e0, block_n=512),
                           "block_n 256 warps 8": replace(e0, block_n=256, num_warps=8),
                           "block_n 512 warps 8": replace(e0, block_n=512, num_warps=8),
                           "warps 2": replace(e0, num_warps=2), "stages 3": replace(e0, num_stages=3)}
        y = kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, max_rank, **kwargs)
        for name, c in shrink_variants.items():
            def run(c=c):
                for layer in range(num_layers):
                    kernels.lora_shrink(x, pool.k(layer), token_adapter, pool.tables, modules, max_rank, config=c,
                                        **kwargs)
            rows.append(_timed_variant(run, num_layers, shrink_bytes, {
                "model": model, "group": group, "batch": num_tokens, "form": form, "op": "shrink",
                "variant": name, "config": repr(c)}))
        for name, c in expand_variants.items():
            def run(c=c):
                for layer in range(num_layers):
                    kernels.lora_expand(y, pool.v(layer), token_adapter, pool.tables, modules, out, out_dims,
                                        config=c, **kwargs)
            rows.append(_timed_variant(run, num_layers, expand_bytes, {
                "model": model, "group": group, "batch": num_tokens, "form": form, "op": "expand",
                "variant": name, "config": repr(c)}))
    return rows


def _timed_variant(run, num_layers: int, nbytes: int, row: dict) -> dict:
    """One launch shape timed per layer call; a shape that cannot compile or launch on this GPU (too much shared
    memory, say) is a row with its error, so the sweep's other shapes still get measured."""
    try:
        us = time_graph(run) / num_layers * 1e3
    except Exception as e:  # noqa: BLE001 (any compile or launch failure of one variant)
        return {**row, "us": None, "gbs": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {**row, "us": us, "gbs": nbytes / us / 1e3}
