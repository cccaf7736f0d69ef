"""Turn the scheduled (request, token count) pairs of one step into the model's ragged batch."""
from __future__ import annotations

import torch

from shared.model_config import MODULES

from .model import ForwardBatch
from .ops.meta import AttnMeta, LoraBatch, LoraTables
from .requests import Sequence


def build_batch(scheduled: list[tuple[Sequence, int]], tables: LoraTables, device: torch.device) -> tuple[ForwardBatch, list[Sequence]]:
    """Returns the batch and, in row order of its logits, the requests that sample this step (those whose
    scheduled tokens reach the end of what they have)."""
    input_ids: list[int] = []
    positions: list[int] = []
    out_slots: list[int] = []
    token_adapter: list[int] = []
    q_start = [0]
    ctx_lens: list[int] = []
    logits_index: list[int] = []
    samplers: list[Sequence] = []
    seg_start = [0]
    seg_adapter: list[int] = []
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
        # Consecutive requests on the same adapter share one segment (the prefill kernel's unit of work).
        if seg_adapter and seg_adapter[-1] == aid:
            seg_start[-1] += n
        else:
            seg_adapter.append(aid)
            seg_start.append(seg_start[-1] + n)
        q_start.append(q_start[-1] + n)
        ctx_lens.append(end)
        if end == len(seq.tokens):
            logits_index.append(q_start[-1] - 1)
            samplers.append(seq)
    max_ctx = max(ctx_lens)
    table = torch.zeros(len(scheduled), max_ctx, dtype=torch.int32)
    for b, (seq, _) in enumerate(scheduled):
        ctx = ctx_lens[b]
        table[b, :ctx] = torch.tensor(seq.slots[:ctx], dtype=torch.int32)

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    max_q = max(b - a for a, b in zip(q_start, q_start[1:]))
    attn = AttnMeta(q_start=dev(q_start, torch.int32), ctx_lens=dev(ctx_lens, torch.int32),
                    slot_table=table.to(device, non_blocking=True), max_q_len=max_q, max_ctx_len=max_ctx,
                    decode_only=max_q == 1)
    lora = None
    if any_lora:
        lora = LoraBatch(tables=tables, token_adapter=dev(token_adapter, torch.int32), max_rank=tuple(max_rank),
                         seg_start=dev(seg_start, torch.int32), seg_adapter=dev(seg_adapter, torch.int32))
    batch = ForwardBatch(input_ids=dev(input_ids, torch.long), positions=dev(positions, torch.long),
                         out_slots=dev(out_slots, torch.int32), attn=attn, lora=lora,
                         logits_index=dev(logits_index, torch.long))
    return batch, samplers
