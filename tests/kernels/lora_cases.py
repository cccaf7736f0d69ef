"""Token batches for the LoRA kernel tests: decode-like (adapters interleaved, some base-only) and
prefill-like (runs of one adapter), in the three launch forms."""
from __future__ import annotations

import torch

from services.gpu_worker.kernels import group_tokens_by_adapter

FORMS = ["token", "grouped", "segments"]


def decode_tokens(num_adapters: int, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Random adapter per token, -1 (base only) included, and every adapter present at least once."""
    ids = torch.randint(-1, num_adapters, (num_tokens,), generator=gen, dtype=torch.int32)
    ids[: num_adapters + 1] = torch.arange(-1, num_adapters, dtype=torch.int32)
    return ids[torch.randperm(num_tokens, generator=gen)].contiguous()


def prefill_runs(lengths: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(adapter, run length) pairs -> token_adapter, seg_start, seg_adapter."""
    token_adapter = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in lengths])
    starts = [0]
    for _, n in lengths:
        starts.append(starts[-1] + n)
    return (token_adapter, torch.tensor(starts, dtype=torch.int32),
            torch.tensor([a for a, _ in lengths], dtype=torch.int32))


def make_batch(form: str, num_adapters: int, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """token_adapter and the launcher keyword arguments of one form."""
    if form == "segments":
        # A run longer than one 16-token tile, runs of 1, a base-only run, and an adapter seen twice.
        token_adapter, seg_start, seg_adapter = prefill_runs([(2, 21), (0, 3), (-1, 2), (1, 4), (3, 1), (2, 2)])
        return token_adapter, {"seg_start": seg_start, "seg_adapter": seg_adapter, "max_seg_len": 21}
    token_adapter = decode_tokens(num_adapters, 11, gen)
    if form == "grouped":
        groups = group_tokens_by_adapter(token_adapter, max_adapters=num_adapters + 1, count_live=True)
        return token_adapter, groups.kwargs()
    return token_adapter, {}
