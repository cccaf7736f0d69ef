"""Decode steps replayed from CUDA graphs, one graph per (batch-size bucket, LoRA rank bucket).

A decode step of a 7B model is ~500 small kernel launches; launching them from Python costs more than the
GPU needs to run them at small batch. Capturing the whole forward once per shape and replaying it makes a
step one launch. Everything a graph reads lives in static buffers: this step's tokens are copied into them
(one host-to-device copy), padding rows write to a scratch slot and attend to it alone.

Shapes fixed at capture: the batch size (padded up to a bucket), the shrink width (the rank bucket: every
adapter in the batch has rank <= it) and the attention split, planned for the context bucket (a power of two
>= the longest context in the batch): planning every step for the longest allowed context would split
short contexts into mostly empty pieces.
"""
from __future__ import annotations

import time

import torch

from shared.model_config import MODULES

from .model import ForwardBatch, LlamaModel
from .ops.meta import AttnMeta, LoraBatch, LoraTables
from .page_table import PageTable
from .pool import UnifiedPool
from .requests import Sequence

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
RANK_BUCKETS = (16, 64)
MIN_CONTEXT_BUCKET = 512
IDS, POS, OUT_SLOT, CTX, ADAPTER, ROW = range(6)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= value)


def capture_plan(batch_buckets: tuple[int, ...], rank_buckets: tuple[int, ...],
                 context_buckets: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(batch, rank, context) keys in capture order: the short contexts every request passes through first,
    within a context the largest batch first (smaller graphs then reuse its memory pool blocks), each batch
    without LoRA and at every rank bucket."""
    return [(size, rank, ctx) for ctx in context_buckets for size in reversed(batch_buckets)
            for rank in (0, *rank_buckets)]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pool: UnifiedPool, tables: LoraTables, page_table: PageTable,
                 max_batch: int, max_rank: int, scratch_slot: int, scratch_row: int):
        self.model, self.pool, self.tables, self.page_table = model, pool, tables, page_table
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.rank_buckets = tuple(r for r in RANK_BUCKETS if r < max_rank) + (max_rank,)
        device = pool.device
        size = self.batch_buckets[-1]
        # Padding rows: token 0 at position 0, written to and attending to the scratch slot only.
        self.padding = torch.tensor([0, 0, scratch_slot, 1, -1, scratch_row], dtype=torch.int32)
        # Two staging buffers, each reused only once its last copy is done: with a step launched ahead
        # (lookahead.py) the previous step's copy may still be queued when the next one is staged.
        self.staging = [torch.empty(6, size, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.staged: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.inputs = self.padding[:, None].repeat(1, size).to(device)
        self.q_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.slot_table = torch.zeros(size, page_table.max_len, dtype=torch.int32, device=device)
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def supports(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_buckets[-1]

    def _context_bucket(self, ctx: int) -> int:
        bucket_len = MIN_CONTEXT_BUCKET
        while bucket_len < ctx:
            bucket_len *= 2
        return min(bucket_len, self.page_table.max_len)

    def _batch(self, size: int, rank: int, ctx: int) -> ForwardBatch:
        x = self.inputs[:, :size]
        attn = AttnMeta(q_start=self.q_start[: size + 1], ctx_lens=x[CTX], slot_table=self.slot_table[:size],
                        max_q_len=1, max_ctx_len=ctx, decode_only=True)
        lora = None
        if rank:
            lora = LoraBatch(tables=self.tables, token_adapter=x[ADAPTER], max_rank=(rank,) * len(MODULES))
        return ForwardBatch(input_ids=x[IDS], positions=x[POS], out_slots=x[OUT_SLOT], attn=attn, lora=lora,
                            logits_index=self.q_start[:size])

    def _forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        torch.index_select(self.page_table.table, 0, self.inputs[ROW, :size], out=self.slot_table[:size])
        return self.model.forward(batch, self.pool)

    def _capture(self, size: int, rank: int, ctx: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.inputs[:, :size] = self.padding[:, None].to(self.inputs.device)
        batch = self._batch(size, rank, ctx)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            for _ in range(2):
                self._forward(batch, size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self._forward(batch, size)
        return graph, logits

    def context_buckets(self, max_context: int) -> tuple[int, ...]:
        """The context buckets a decode step of contexts up to `max_context` can use, smallest first."""
        out = [self._context_bucket(1)]
        while out[-1] < self._context_bucket(max_context):
            out.append(self._context_bucket(out[-1] + 1))
        return tuple(out)

    def capture_all(self, max_context: int, deadline: float) -> int:
        """Capture the graphs of every (batch, rank, context) bucket for contexts up to `max_context` before
        traffic, as far as `deadline` allows (the rest are captured on first use). A graph first seen under
        load costs its capture and the kernel compiles of its shapes, about a second each, in a step every
        running request waits for. Returns how many graphs were captured."""
        done = 0
        for key in capture_plan(self.batch_buckets, self.rank_buckets, self.context_buckets(max_context)):
            if time.monotonic() >= deadline:
                break
            if key not in self.graphs:
                self._graph(*key)
                done += 1
        return done

    def _graph(self, size: int, rank: int, ctx: int):
        key = (size, rank, ctx)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, rank, ctx)
        return self.graphs[key]

    def run(self, seqs: list[Sequence], max_rank: int, device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """Logits `[len(seqs), vocab]` for a decode step (each request has exactly one token to run).
        `device_tokens` = (ids, rows): the step's input tokens are `ids[rows]`, sampled on the device by the
        step before and not yet known to the host (lookahead.py)."""
        n = len(seqs)
        size = bucket(n, self.batch_buckets)
        rank = bucket(max_rank, self.rank_buckets) if max_rank else 0
        graph, logits = self._graph(size, rank, self._context_bucket(max(s.num_computed + 1 for s in seqs)))
        rows = [[s.tokens[-1] for s in seqs], [s.num_computed for s in seqs], [s.slots[s.num_computed] for s in seqs],
                [s.num_computed + 1 for s in seqs],
                [s.adapter.resident_id if s.adapter is not None else -1 for s in seqs], [s.row for s in seqs]]
        host, done = self.staging[self.turn], self.staged[self.turn]
        if done is not None:
            done.synchronize()
        host[:, :n] = torch.tensor(rows, dtype=torch.int32)
        host[:, n:size] = self.padding[:, None]
        self.page_table.flush()
        self.inputs[:, :size].copy_(host[:, :size], non_blocking=True)
        self.staged[self.turn] = torch.cuda.Event()
        self.staged[self.turn].record()
        self.turn ^= 1
        if device_tokens is not None:
            ids, rows = device_tokens
            self.inputs[IDS, :n].copy_(ids.index_select(0, rows))
        graph.replay()
        return logits[:n]
