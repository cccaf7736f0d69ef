"""Turn the scheduled (request, token count) pairs of one step into the model's ragged batch.

Host work is O(tokens scheduled): context slot ids come from the persistent device page table, and every
per-token and per-request array travels to the device in one copy.
"""
from __future__ import annotations

from collections import Counter

import torch

from shared.model_config import MODULES

from .model import ForwardBatch
from .ops.meta import AttnMeta, LoraBatch, LoraTables
from .page_table import PageTable
from .requests import Sequence


def build_batch(scheduled: list[tuple[Sequence, int]], tables: LoraTables, page_table: PageTable,
                device: torch.device) -> tuple[ForwardBatch, list[Sequence]]:
    """Returns the batch and, in row order of its logits, the requests that sample this step (those whose
    scheduled tokens reach the end of what they have)."""
    input_ids: list[int] = []
    positions: list[int] = []
    out_slots: list[int] = []
    token_adapter: list[int] = []
    q_start = [0]
    ctx_lens: list[int] = []
    rows: list[int] = []
    logits_index: list[int] = []
    samplers: list[Sequence] = []
    max_rank = [0] * len(MODULES)
    any_lora = False
    for seq, n in scheduled:
        start, end = seq.num_computed, seq.num_computed + n
        input_ids += seq.tokens[start:end]
        positions += range(start, end)
        out_slots += seq.slots[start:end]
        aid = seq.adapter.resident_id if seq.adapter is not None else -1
        token_adapter += [aid] * n
        if seq.adapter is not None:
            any_lora = True
            max_rank = [max(a, b) for a, b in zip(max_rank, seq.adapter.ranks)]
        q_start.append(q_start[-1] + n)
        ctx_lens.append(end)
        rows.append(seq.row)
        if end == len(seq.tokens):
            logits_index.append(q_start[-1] - 1)
            samplers.append(seq)
    page_table.flush()
    parts = [input_ids, positions, out_slots, token_adapter, q_start, ctx_lens, rows, logits_index]
    flat = torch.tensor([v for p in parts for v in p], dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    sizes = [len(p) for p in parts]
    ids, pos, slots, adapters, q_start_d, ctx_d, rows_d, logits_idx = flat.split(sizes)
    max_ctx = max(ctx_lens)
    max_q = max(b - a for a, b in zip(q_start, q_start[1:]))
    decode_seqs = 0
    if max_q > 1:
        while q_start[decode_seqs + 1] - q_start[decode_seqs] == 1:
            decode_seqs += 1
    attn = AttnMeta(q_start=q_start_d, ctx_lens=ctx_d, slot_table=page_table.gather(rows_d, max_ctx),
                    max_q_len=max_q, max_ctx_len=max_ctx, decode_only=max_q == 1, decode_seqs=decode_seqs,
                    decode_max_ctx=max(ctx_lens[:decode_seqs], default=0))
    lora = None
    if any_lora:
        per_adapter = Counter()
        for seq, n in scheduled:
            per_adapter[seq.adapter.resident_id if seq.adapter is not None else -1] += n
        lora = LoraBatch(tables=tables, token_adapter=adapters, max_rank=tuple(max_rank),
                         segment_lengths=tuple(per_adapter.values()))
    batch = ForwardBatch(input_ids=ids, positions=pos, out_slots=slots, attn=attn, lora=lora, logits_index=logits_idx)
    return batch, samplers
