"""CUDA backend: the Triton kernels, with per-step LoRA grouping done once and shared by every layer."""
from __future__ import annotations


from ..kernels import attention, group_tokens_by_adapter, lora_expand, lora_shrink, write_kv
from ..kernels.rms_norm import add_rms_norm, rms_norm
from ..kernels.rotary import rotary
from ..kernels.silu_mul import silu_mul
from ..kernels.lora_groups import PREFILL_CHUNK_TOKENS, chunk_count
from .meta import LoraBatch

__all__ = ["write_kv", "attention", "lora_shrink", "lora_expand", "prepare_lora", "rms_norm", "add_rms_norm",
           "rotary", "silu_mul"]


def prepare_lora(lora: LoraBatch) -> None:
    """Sort the step's tokens by adapter on the device (no host sync), so each adapter's rows are read once
    per step by the segment form of shrink and expand, at decode and prefill alike."""
    graph = lora.segment_lengths is None
    # A graph launches a segment per token; the host has planned it for `live_segments` busy ones at most
    # (cuda_graphs.py), and steps whose adapters the host knows launch exactly their segments.
    programs = lora.segment_programs if graph else 0
    # A step with long segments (prefill) lists the chunks that hold tokens, so its launches run only those
    # instead of every segment times the longest one's chunk count.
    long_segments = not graph and lora.max_seg_len > PREFILL_CHUNK_TOKENS
    num_chunks = chunk_count(lora.segment_lengths) if long_segments else None
    groups = group_tokens_by_adapter(lora.token_adapter, lora.tables.ranks.shape[0], lora.num_segments,
                                     count_live=programs > 0, num_chunks=num_chunks)
    # `plan`: the step's launches, worked out (checks, launch shape) at the first layer and reused by the
    # others; on the H200 that work is a third of a shrink or expand call's host time
    # (benchmarks/lora_launch_cost.py), and an admission step's launch outlasts the decode step it follows.
    lora.kernel_args = {**groups.kwargs(), "max_seg_len": lora.max_seg_len,
                        "live_segments": lora.live_segments if graph else None, "segment_programs": programs,
                        "plan": {}}
