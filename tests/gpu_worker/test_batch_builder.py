"""A step's batch: the LoRA launch hints the host knows when it builds the step."""
from __future__ import annotations

import torch

from services.gpu_worker.batch_builder import build_batch
from services.gpu_worker.ops.meta import LoraTables
from services.gpu_worker.page_table import PageTable
from services.gpu_worker.requests import EngineRequest, Sequence
from services.gpu_worker.resident_adapters import Resident

CPU = torch.device("cpu")


def tables(rows: int = 4096) -> LoraTables:
    zeros = torch.zeros(rows, 7, dtype=torch.int32)
    return LoraTables(slots=torch.zeros(rows, 8, dtype=torch.int32), ranks=zeros, a_off=zeros, b_off=zeros)


def running(page_table: PageTable, i: int, prompt_len: int, adapter: Resident | None) -> Sequence:
    seq = Sequence(EngineRequest(f"r{i}", list(range(1, prompt_len + 1))), order=i)
    seq.row = page_table.assign_row()
    seq.slots = list(range(100 * i, 100 * i + prompt_len))
    page_table.append(seq.row, 0, seq.slots)
    seq.adapter = adapter
    return seq


def test_a_prefill_step_counts_its_distinct_adapters_and_longest_run():
    page_table = PageTable(8, 64, CPU)
    a = Resident("a", 3, [], (8,) * 7)
    b = Resident("b", 7, [], (16,) * 7)
    seqs = [running(page_table, 0, 10, a), running(page_table, 1, 20, None), running(page_table, 2, 15, a),
            running(page_table, 3, 4, b)]
    batch, samplers = build_batch([(s, s.remaining) for s in seqs], tables(), page_table, CPU)
    lora = batch.lora
    # Three runs (a, base-only, b): the segment kernels launch three, not one per resident table row.
    assert lora.num_segments == 3
    assert lora.max_seg_len == 25
    assert lora.max_rank == (16,) * 7
    assert lora.token_adapter.tolist() == [3] * 10 + [-1] * 20 + [3] * 15 + [7] * 4
    assert [s.request_id for s in samplers] == ["r0", "r1", "r2", "r3"]


def test_a_base_only_step_has_no_lora_part():
    page_table = PageTable(4, 16, CPU)
    seqs = [running(page_table, 0, 5, None), running(page_table, 1, 3, None)]
    batch, _ = build_batch([(s, s.remaining) for s in seqs], tables(), page_table, CPU)
    assert batch.lora is None
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 3]


def test_a_mixed_step_names_its_leading_decode_rows_and_their_longest_context():
    page_table = PageTable(8, 64, CPU)
    decoding = [running(page_table, i, n, None) for i, n in enumerate((12, 30, 7))]
    for seq in decoding:
        seq.num_computed = len(seq.tokens) - 1  # one token left: a decode row
    prompt = running(page_table, 3, 9, None)
    late = running(page_table, 4, 40, None)
    late.num_computed = 39
    batch, _ = build_batch([(s, s.remaining) for s in decoding + [prompt, late]], tables(), page_table, CPU)
    attn = batch.attn
    # Three decode rows lead; the one scheduled after the prompt is the prompt launch's to take.
    assert (attn.decode_seqs, attn.decode_max_ctx) == (3, 30)
    assert (attn.max_q_len, attn.max_ctx_len, attn.decode_only) == (9, 40, False)
    decode_only, _ = build_batch([(s, 1) for s in decoding], tables(), page_table, CPU)
    assert decode_only.attn.decode_only and decode_only.attn.decode_seqs == 0
