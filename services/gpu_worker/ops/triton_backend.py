"""CUDA backend: the Triton kernels, with per-step LoRA grouping done once and shared by every layer."""
from __future__ import annotations


from ..kernels import attention, group_tokens_by_adapter, lora_expand, lora_shrink, write_kv
from ..kernels.rms_norm import add_rms_norm, rms_norm
from ..kernels.rotary import rotary
from ..kernels.silu_mul import silu_mul
from .meta import LoraBatch

__all__ = ["write_kv", "attention", "lora_shrink", "lora_expand", "prepare_lora", "rms_norm", "add_rms_norm",
           "rotary", "silu_mul"]


# How many adapters a step whose adapters the host does not know (a CUDA graph) is planned for: the graph
# launches a segment per token, but a decode batch of 256 usually carries a few to ~100 adapters. Planning
# shrink's input split for 256 busy segments split it once, so a step of 5 adapters ran on 30 programs.
GRAPH_LIVE_SEGMENTS = 16
# Programs that share a graph's segments out (0: one per segment, most of which find no tokens and return).
# benchmarks/kernels/graph_live_segments.py measures both ways; the choice follows its GPU run.
GRAPH_SEGMENT_PROGRAMS = 0


def prepare_lora(lora: LoraBatch) -> None:
    """Sort the step's tokens by adapter on the device (no host sync), so each adapter's rows are read once
    per step by the segment form of shrink and expand, at decode and prefill alike."""
    graph = lora.num_segments is None
    programs = GRAPH_SEGMENT_PROGRAMS if graph else 0
    groups = group_tokens_by_adapter(lora.token_adapter, lora.tables.ranks.shape[0], lora.num_segments,
                                     count_live=programs > 0)
    lora.kernel_args = {**groups.kwargs(), "max_seg_len": lora.max_seg_len,
                        "live_segments": GRAPH_LIVE_SEGMENTS if graph else None, "segment_programs": programs}
