"""Group a step's tokens by adapter on the device, for the segment form of shrink/expand at decode.

With tokens sorted by adapter, each adapter's rows are read from memory once per step instead of once per
token. Everything here is a handful of torch ops with shapes fixed by the token count, so it needs no host
synchronisation and can be captured in a CUDA graph; the engine runs it once per step and every layer's
LoRA launches reuse the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_tensor

# Long runs of one adapter (prefill) are cut into chunks of this many tokens, a program each, by both
# shrink and expand (choose_shrink_config, choose_expand_config).
PREFILL_CHUNK_TOKENS = 64


def long_on_average(num_tokens: int, num_segments: int | None) -> bool:
    """Whether a chunked launch's segments average 32 tokens or more (its chunks are mostly full, where a
    decode step grouped by adapter has a few tokens a segment): shrink's 64-row tiles, and its input split
    planned for every segment's share of the longest one's chunks (choose_shrink_config)."""
    return num_tokens >= 32 * (num_segments or 1)


# A chunked launch whose segments average this many tokens (8 full chunks) is a prefill of few long prompts;
# below it, of many short ones beside decode tokens. On the H200 an S2 admission step (8687 tokens,
# benchmarks/kernels/admission_shapes.py) sits at 1737 tokens a segment over 5 adapters and 87 over 100, and
# the launch shapes that won at one lost at the other (choose_shrink_config, choose_expand_config).
FULL_SEGMENT_TOKENS = 512


def full_on_average(num_tokens: int, num_segments: int | None) -> bool:
    """Whether a chunked launch's segments average FULL_SEGMENT_TOKENS or more."""
    return num_tokens >= FULL_SEGMENT_TOKENS * (num_segments or 1)


@dataclass
class ChunkItems:
    """Every (segment, chunk) pair that holds tokens, for a launch of one program per pair: table[0] the
    segment, table[1] the chunk's index within it (chunks of `chunk_tokens`). Without it a segment-form
    launch covers every segment with as many chunks as the longest one has, so a prefill step (a few long
    prompts beside many one-token decode segments) launches mostly programs that find no tokens."""

    table: torch.Tensor  # int32 [2, N]
    chunk_tokens: int

    @property
    def count(self) -> int:
        return int(self.table.shape[1])


def chunk_count(segment_lengths, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> int:
    """Chunks of `chunk_tokens` the segments of these lengths (host ints) hold."""
    return sum(-(-n // chunk_tokens) for n in segment_lengths)


@dataclass
class AdapterGroups:
    """token_order[p]: the token at sorted position p. Segment s covers positions seg_start[s] ...
    seg_start[s+1] - 1, all using adapter seg_adapter[s] (-1 for base-only tokens). There are a fixed
    number of segments (an upper bound); unused ones are empty and have adapter -1."""

    token_order: torch.Tensor  # int32 [T]
    seg_start: torch.Tensor  # int32 [S + 1]
    seg_adapter: torch.Tensor  # int32 [S]
    # int32 [1], when asked for: segments 0 .. num_live - 1 hold tokens, the rest are empty.
    num_live: torch.Tensor | None = None
    chunk_items: ChunkItems | None = None  # when asked for (an eager step with long segments)

    def kwargs(self) -> dict:
        out = {"seg_start": self.seg_start, "seg_adapter": self.seg_adapter, "token_order": self.token_order}
        if self.num_live is not None:
            out["num_live"] = self.num_live
        if self.chunk_items is not None:
            out["chunk_items"] = self.chunk_items
        return out


def group_tokens_by_adapter(token_adapter: torch.Tensor, max_adapters: int | None = None,
                            num_distinct: int | None = None, count_live: bool = False,
                            num_chunks: int | None = None,
                            chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> AdapterGroups:
    """Sort tokens by adapter (stable) and cut the sorted order into runs of one adapter.

    max_adapters (resident table rows; adapter ids lie in 0 .. max_adapters - 1) bounds the number of
    distinct adapters, so at most max_adapters + 1 segments (the +1 for base-only tokens) are launched
    instead of one per token. num_distinct, when the caller knows it (an eager step built on the host), is
    the exact number of distinct ids, base-only included: it must not be an underestimate. count_live also
    leaves the number of segments in use on the device (for kernels that share segments out among fewer
    programs; one more small op per step, so only when asked). num_chunks, when the host knows it (the
    chunks of `chunk_tokens` its segments hold, chunk_count; with num_distinct exact), also lists them
    (ChunkItems), a few more small ops per step, none of them a host sync."""
    check_tensor("token_adapter", token_adapter, ndim=1, dtypes=(torch.int32,), contiguous=True)
    device = token_adapter.device
    num_tokens = token_adapter.shape[0]
    num_segments = num_tokens if max_adapters is None else max(1, min(num_tokens, max_adapters + 1))
    if num_distinct is not None:
        num_segments = max(1, min(num_segments, num_distinct))
    if num_tokens == 0:
        empty = torch.zeros(1, dtype=torch.int32, device=device)
        return AdapterGroups(empty[:0], empty, empty[:0], empty.clone() if count_live else None)
    sorted_adapter, order = torch.sort(token_adapter, stable=True)
    is_start = torch.ones(num_tokens, dtype=torch.bool, device=device)
    is_start[1:] = sorted_adapter[1:] != sorted_adapter[:-1]
    seg_id = torch.cumsum(is_start, 0) - 1
    positions = torch.arange(num_tokens, device=device)
    # Non-start positions scatter into a dump entry past the end, so no boolean indexing (a host sync).
    seg_start = torch.full((num_segments + 2,), num_tokens, dtype=torch.int64, device=device)
    seg_start.scatter_(0, torch.where(is_start, seg_id, num_segments + 1), positions)
    seg_adapter = torch.full((num_segments,), -1, dtype=torch.int32, device=device)
    seg_adapter.scatter_(0, seg_id, sorted_adapter)
    num_live = (seg_id[-1:] + 1).to(torch.int32) if count_live else None
    seg_start = seg_start[: num_segments + 1]
    items = None
    if num_chunks is not None:
        items = ChunkItems(_chunk_table(seg_start, chunk_tokens, num_chunks), chunk_tokens)
    return AdapterGroups(order.to(torch.int32), seg_start.to(torch.int32), seg_adapter, num_live, items)


def _chunk_table(seg_start: torch.Tensor, chunk_tokens: int, num_chunks: int) -> torch.Tensor:
    """ChunkItems.table for segments bounded by seg_start (int64 [S + 1]); num_chunks must be their exact
    chunk count (output_size keeps repeat_interleave from reading it back from the device)."""
    per_segment = (seg_start[1:] - seg_start[:-1] + chunk_tokens - 1) // chunk_tokens
    segment = torch.arange(per_segment.shape[0], device=seg_start.device)
    item_segment = torch.repeat_interleave(segment, per_segment, output_size=num_chunks)
    first_item = torch.cumsum(per_segment, 0) - per_segment
    index = torch.arange(num_chunks, device=seg_start.device) - first_item[item_segment]
    return torch.stack([item_segment, index]).to(torch.int32)
