"""CUDA backend: the Triton kernels, with per-step LoRA grouping done once and shared by every layer."""
from __future__ import annotations


from ..kernels import attention, group_tokens_by_adapter, lora_expand, lora_shrink, write_kv
from ..kernels.rms_norm import add_rms_norm, rms_norm
from ..kernels.rotary import rotary
from ..kernels.silu_mul import silu_mul
from .meta import LoraBatch

__all__ = ["write_kv", "attention", "lora_shrink", "lora_expand", "prepare_lora", "rms_norm", "add_rms_norm",
           "rotary", "silu_mul"]


def prepare_lora(lora: LoraBatch) -> None:
    """Sort the step's tokens by adapter on the device (no host sync), so each adapter's rows are read once
    per step by the segment form of shrink and expand, at decode and prefill alike."""
    graph = lora.num_segments is None
    # A graph launches a segment per token; the host has planned it for `live_segments` busy ones at most
    # (cuda_graphs.py), and steps whose adapters the host knows launch exactly their segments.
    programs = lora.segment_programs if graph else 0
    groups = group_tokens_by_adapter(lora.token_adapter, lora.tables.ranks.shape[0], lora.num_segments,
                                     count_live=programs > 0)
    lora.kernel_args = {**groups.kwargs(), "max_seg_len": lora.max_seg_len,
                        "live_segments": lora.live_segments if graph else None, "segment_programs": programs}
