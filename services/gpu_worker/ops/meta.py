"""Per-step metadata the attention and LoRA ops read. Built once per step by the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMeta:
    """Ragged batch of sequences; sequence b has q_len_b new tokens and ctx_len_b tokens of context
    (including the new ones, whose K/V are already written to the pool). New token j of sequence b sits
    at position ctx_len_b - q_len_b + j and attends to positions <= its own."""

    q_start: torch.Tensor  # int32 [B + 1]: offsets of each sequence's new tokens in the flat token axis
    ctx_lens: torch.Tensor  # int32 [B]
    slot_table: torch.Tensor  # int32 [B, max_ctx]: slot id of each context position (page table, 1 token/page)
    max_q_len: int
    max_ctx_len: int
    decode_only: bool  # every sequence has exactly one new token
    # A mixed step's leading sequences with one new token (its decode rows, scheduled before the prompts) and
    # their longest context, known on the host: attention may launch them apart, in decode-shaped tiles.
    # 0 = none or not known.
    decode_seqs: int = 0
    decode_max_ctx: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.ctx_lens.shape[0])


@dataclass
class LoraTables:
    """Where each resident adapter's rows live in the pool, indexed by its resident id.

    Module index order is shared.model_config.MODULES. Rank 0 means the module is not adapted. Row i of
    module m's A spans entries a_off[m] + i*ceil(in/W) ... of slots[id]; likewise Bᵀ from b_off[m]."""

    slots: torch.Tensor  # int32 [max_resident, max_slots_per_adapter]
    ranks: torch.Tensor  # int32 [max_resident, 7]
    a_off: torch.Tensor  # int32 [max_resident, 7]
    b_off: torch.Tensor  # int32 [max_resident, 7]


@dataclass
class LoraBatch:
    """The LoRA part of one step: which resident adapter each token uses (-1 = base only), and the
    largest rank per module among adapters in this step (bounds the shrink output width)."""

    tables: LoraTables
    token_adapter: torch.Tensor  # int32 [T]
    max_rank: tuple[int, ...]  # per module, over this step's adapters
    # Tokens of each distinct adapter id among the step's tokens (base-only counts as one; host ints, any
    # order), known on the host at build time; None = unknown (a CUDA graph). From it the segment kernels
    # launch exactly the step's segments (num_segments), split long prefill runs (max_seg_len) and list the
    # chunks that hold tokens.
    segment_lengths: tuple[int, ...] | None = None
    # A CUDA graph's launch plan (segment_lengths None): how many of its segments may carry tokens (None = all)
    # and how many programs per column tile share them out (0 = one per segment). Never changes results.
    live_segments: int | None = None
    segment_programs: int = 0
    # Backend-specific launch hints (e.g. tokens grouped by adapter); they never change results.
    kernel_args: dict = field(default_factory=dict)
    # A decode graph's stacked LoRA (kernel_shapes graph_few_stacked): the stacks (graph_stacks.GraphStacks) and
    # the column count of the buffers it reads; the model then runs ops.stacked_lora instead of the backend's
    # shrink and expand. 0: the segment launches. stack_held: the rows are read from the held buffers
    # (held_stacks.py), not gathered from the pool.
    stacks: object | None = None
    stack_columns: int = 0
    stack_held: bool = False

    @property
    def num_segments(self) -> int | None:
        return None if self.segment_lengths is None else len(self.segment_lengths)

    @property
    def max_seg_len(self) -> int | None:
        return None if self.segment_lengths is None else max(self.segment_lengths)

    def group_max_rank(self, modules: tuple[int, ...]) -> int:
        return max(self.max_rank[m] for m in modules)
