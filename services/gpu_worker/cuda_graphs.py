"""Decode steps replayed from CUDA graphs, one graph per (batch-size bucket, LoRA rank bucket, context bucket,
LoRA launch plan, LoRA groups in use).

A decode step of a 7B model is ~500 small kernel launches; launching them from Python costs more than the
GPU needs to run them at small batch. Capturing the whole forward once per shape and replaying it makes a
step one launch. Everything a graph reads lives in static buffers: this step's tokens are copied into them
(one host-to-device copy), padding rows write to a scratch slot and attend to it alone.

Shapes fixed at capture: the batch size (padded up to a bucket), the shrink width (the rank bucket: every
adapter in the batch has rank <= it) and the attention split, planned for the context bucket (a power of two
>= the longest context in the batch): planning every step for the longest allowed context would split
short contexts into mostly empty pieces.

A graph runs the LoRA kernels of the module groups (q,k,v; o; gate,up; down) its step's adapters adapt, no
others: adapters of q,k,v,o alone (S-LoRA's S1 and S2) would otherwise launch the MLP's shrink and expand
on every layer, programs that each find rank 0 and return, at about the cost of the groups doing work.
Warm-up captures the graphs of the groups the served adapters adapt (cuda_graph_lora_targets; every group
when unset, which compiles every kernel a graph launches); a step whose adapters use other groups replays a
graph of its own groups, captured at its first use.

A graph cannot know which adapters its step carries, so its LoRA kernels launch a segment per token. With
`few_adapters` set, steps of at most that many distinct adapters replay graphs of their own, whose launches are
planned for that many busy segments and share the segments out among a few programs, which skip the unused
ones; the other steps replay graphs planned for every segment (at ~100 adapters in a batch of 256 most
segments are busy, and that plan is the faster one). With kernel_shapes' graph_few_stacked = N, steps of at most
N distinct adapters replay graphs whose LoRA is dense products over the adapters' rows side by side
(ops/stacked_lora.py), keyed by their column count (graph_stacks.py) and by whether they read the rows from held
buffers (graph_stacked_held, held_stacks.py) or gather them; captured at first use, not at warm-up.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple

import torch

from shared.model_config import MODULES

from .graph_stacks import GraphStacks, stacked_columns
from .kernels.launch_shapes import launch_shapes
from .model import DOWN, GATE_UP, O, QKV, ForwardBatch, LlamaModel
from .ops.meta import AttnMeta, LoraBatch, LoraTables
from .page_table import PageTable
from .pool import UnifiedPool
from .requests import Sequence

SMALL_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
RANK_BUCKETS = (16, 64)
MIN_CONTEXT_BUCKET = 512
IDS, POS, OUT_SLOT, CTX, ADAPTER, ROW = range(6)
LORA_GROUPS = (QKV, O, GATE_UP, DOWN)
ALL_GROUPS = (True,) * len(LORA_GROUPS)
NO_GROUPS = (False,) * len(LORA_GROUPS)
GROUP_OF_MODULE = tuple(next(i for i, g in enumerate(LORA_GROUPS) if m in g) for m in range(len(MODULES)))


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= value)


@functools.lru_cache(maxsize=None)
def batch_buckets(max_batch: int, step: int = 64) -> tuple[int, ...]:
    """The batch sizes decode graphs are captured for, up to `max_batch`: the small sizes to 128, then every
    min(step, 32) rows to 256 and every `step` rows past it (kernel_shapes graph_batch_step). A step replays the
    smallest holding its rows, and the rows past them are padding that the base GEMMs still compute: at served
    batches of 384 and 512 those GEMMs are bound by their FLOPs, so a step of 330 rows in a graph of 384 spends
    ~16% more on them than its own rows need."""
    sizes = list(SMALL_BATCH_BUCKETS)
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (min(step, 32) if sizes[-1] < 256 else step))
    return tuple(b for b in sizes if b < max_batch) + (max_batch,)


def context_bucket(ctx: int, max_len: int) -> int:
    """The context a decode graph is planned for, for a step whose longest context is `ctx`: a power of two
    from MIN_CONTEXT_BUCKET, at most `max_len` (the page table's)."""
    bucket_len = MIN_CONTEXT_BUCKET
    while bucket_len < ctx:
        bucket_len *= 2
    return min(bucket_len, max_len)


def lora_plans(size: int, few_adapters: int) -> tuple[bool, ...]:
    """The LoRA launch plans a batch bucket replays (True = the few-adapter plan): a bucket of at most
    `few_adapters` requests never carries more adapters than that."""
    if not few_adapters:
        return (False,)
    return (True,) if size <= few_adapters else (True, False)


def step_ranks(adapter_ranks: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The largest rank per module among a step's adapters (zeros for a base-only step)."""
    return tuple(max(r) for r in zip(*adapter_ranks)) if adapter_ranks else (0,) * len(MODULES)


def lora_groups(ranks: tuple[int, ...]) -> tuple[bool, ...]:
    """Which LoRA module groups a step with these per-module ranks runs (any module of the group adapted)."""
    return tuple(any(ranks[m] for m in group) for group in LORA_GROUPS)


def group_ranks(rank: int, groups: tuple[bool, ...]) -> tuple[int, ...]:
    """Per-module ranks of a graph of rank bucket `rank` running the LoRA `groups` (0 skips a module)."""
    return tuple(rank if groups[GROUP_OF_MODULE[m]] else 0 for m in range(len(MODULES)))


def groups_of_modules(names: tuple[str, ...]) -> tuple[bool, ...]:
    """The LoRA groups that adapters of these modules run."""
    return lora_groups(tuple(int(m in names) for m in MODULES))


def busy_segments(adapter_ids: list[int | None], size: int) -> int:
    """Segments carrying tokens in a step of these requests' resident adapter ids (None = base model)
    padded to `size`: one per adapter and one for base-model requests and padding rows together."""
    base = len(adapter_ids) < size or None in adapter_ids
    return len({a for a in adapter_ids if a is not None}) + base


def step_residents(seqs: list[Sequence]) -> list:
    """A step's distinct adapters (resident_adapters.Resident), by resident id: steps over the same adapters
    stack them alike whatever the order of their requests, and the stacks are not filled again."""
    by_id = {s.adapter.resident_id: s.adapter for s in seqs if s.adapter is not None}
    return [by_id[i] for i in sorted(by_id)]


class StackPlan(NamedTuple):
    """A stacked graph's LoRA: its column count, and whether it reads the rows from the held buffers."""
    columns: int
    held: bool


def stacked_plan(residents: list, most: int, held: int = 0) -> StackPlan | None:
    """The stacked graph a LoRA step over these adapters replays (kernel_shapes graph_few_stacked = `most`,
    graph_stacked_held = `held`), or None for the segment launches: more than `most` adapters, more columns than
    `held` allows, or the word off."""
    if not most or not residents or len(residents) > most:
        return None
    columns = stacked_columns([max(r.ranks) for r in residents])
    if held and columns > held:
        return None
    return StackPlan(columns, bool(held))


# batch, rank, context, LoRA plan, LoRA groups. The plan: False, the segment launches planned for every segment;
# True, the few-adapter plan; a StackPlan, the stacked products.
GraphKey = tuple[int, int, int, "bool | StackPlan", tuple[bool, ...]]


def capture_plan(batch_buckets: tuple[int, ...], rank_buckets: tuple[int, ...],
                 context_buckets: tuple[int, ...], few_adapters: int = 0,
                 groups: tuple[bool, ...] = ALL_GROUPS) -> list[GraphKey]:
    """Keys of the graphs warm-up captures, in capture order: the short contexts every request passes
    through first, within a context the largest batch first (smaller graphs then reuse its memory pool
    blocks), each batch without LoRA and at every rank bucket under each of its LoRA launch plans, running
    the LoRA `groups`."""
    return [(size, rank, ctx, few, groups if rank else NO_GROUPS)
            for ctx in context_buckets for size in reversed(batch_buckets)
            for rank in (0, *rank_buckets) for few in ((False,) if not rank else lora_plans(size, few_adapters))]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pool: UnifiedPool, tables: LoraTables, page_table: PageTable,
                 max_batch: int, max_rank: int, scratch_slot: int, scratch_row: int, few_adapters: int = 0,
                 segment_programs: int = 32, warm_groups: tuple[bool, ...] = ALL_GROUPS,
                 stacks: GraphStacks | None = None):
        self.model, self.pool, self.tables, self.page_table = model, pool, tables, page_table
        self.stacks = stacks
        self.few_adapters, self.segment_programs, self.warm_groups = few_adapters, segment_programs, warm_groups
        self.max_batch = max_batch
        self.rank_buckets = tuple(r for r in RANK_BUCKETS if r < max_rank) + (max_rank,)
        device = pool.device
        size = max_batch
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
        # One logits buffer written by every graph. A graph's own output would stay allocated in the shared
        # memory pool for the graph's lifetime: [batch, vocab] fp32 each (262 MB at batch 512 over Llama-3's
        # 128k vocabulary), several GB over a warm-up's graphs, which ran an 80 GB card out of memory.
        # Sharing it is safe as sharing one graph is: a step's logits are read before the next step's replay
        # unless every row is greedy, whose argmax is queued before it (lookahead.py).
        self.logits = torch.empty(size, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # Graphs captured at first use, under load (not by capture_all), and the host's seconds in those
        # captures (with their kernels' compiles): a step that captures waits for it, and so does every running
        # request. The engine counts them into its step counters (step_stats.py).
        self.live_captures = 0
        self.live_capture_s = 0.0

    def supports(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """Read at each step, so a setting switched between steps (benchmarks/decode_ab.py) buckets by its own."""
        return batch_buckets(self.max_batch, launch_shapes().graph_batch_step)

    def _context_bucket(self, ctx: int) -> int:
        return context_bucket(ctx, self.page_table.max_len)

    def _batch(self, size: int, rank: int, ctx: int, few: "bool | StackPlan", groups: tuple[bool, ...]) -> ForwardBatch:
        x = self.inputs[:, :size]
        attn = AttnMeta(q_start=self.q_start[: size + 1], ctx_lens=x[CTX], slot_table=self.slot_table[:size],
                        max_q_len=1, max_ctx_len=ctx, decode_only=True)
        lora = None
        if rank:
            lora = LoraBatch(tables=self.tables, token_adapter=x[ADAPTER], max_rank=group_ranks(rank, groups))
            if few is True:
                lora.live_segments, lora.segment_programs = self.few_adapters, self.segment_programs
            elif few:
                lora.stacks, lora.stack_columns, lora.stack_held = self.stacks, few.columns, few.held
        return ForwardBatch(input_ids=x[IDS], positions=x[POS], out_slots=x[OUT_SLOT], attn=attn, lora=lora,
                            logits_index=self.q_start[:size])

    def _forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        torch.index_select(self.page_table.table, 0, self.inputs[ROW, :size], out=self.slot_table[:size])
        return self.model.forward(batch, self.pool, logits_out=self.logits[:size])

    def _capture(self, size: int, rank: int, ctx: int, few: "bool | StackPlan", groups: tuple[bool, ...]) -> torch.cuda.CUDAGraph:
        self.inputs[:, :size] = self.padding[:, None].to(self.inputs.device)
        batch = self._batch(size, rank, ctx, few, groups)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            for _ in range(2):
                self._forward(batch, size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            self._forward(batch, size)  # into self.logits
        return graph

    def context_buckets(self, max_context: int) -> tuple[int, ...]:
        """The context buckets a decode step of contexts up to `max_context` can use, smallest first."""
        out = [self._context_bucket(1)]
        while out[-1] < self._context_bucket(max_context):
            out.append(self._context_bucket(out[-1] + 1))
        return tuple(out)

    def capture_all(self, max_context: int, deadline: float) -> int:
        """Capture the graphs of `capture_plan` (every batch, rank and context bucket, each LoRA launch plan) for
        contexts up to `max_context` before traffic, as far as `deadline` allows (the rest are captured on
        first use). A graph first seen under
        load costs its capture and the kernel compiles of its shapes, about a second each, in a step every
        running request waits for. Returns how many graphs were captured."""
        done = 0
        for key in capture_plan(self.batch_buckets, self.rank_buckets, self.context_buckets(max_context),
                                self.few_adapters, self.warm_groups):
            if time.monotonic() >= deadline:
                break
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
                done += 1
        return done

    def _graph(self, size: int, rank: int, ctx: int, few: "bool | StackPlan", groups: tuple[bool, ...]) -> torch.cuda.CUDAGraph:
        """The step's graph, captured now if warm-up did not (counted: a capture under load)."""
        key = (size, rank, ctx, few, groups)
        if key not in self.graphs:
            started = time.perf_counter()
            self.graphs[key] = self._capture(*key)
            self.live_captures += 1
            self.live_capture_s += time.perf_counter() - started
        return self.graphs[key]

    def run(self, seqs: list[Sequence], device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """Logits `[len(seqs), vocab]` for a decode step (each request has exactly one token to run).
        `device_tokens` = (ids, rows): the first len(rows) requests' input tokens are `ids[rows]`, sampled on
        the device by the step before and not yet known to the host (lookahead.py)."""
        n = len(seqs)
        shapes = launch_shapes()
        size = bucket(n, batch_buckets(self.max_batch, shapes.graph_batch_step))
        adapter_ids = [s.adapter.resident_id if s.adapter is not None else None for s in seqs]
        ranks = step_ranks([s.adapter.ranks for s in seqs if s.adapter is not None])
        top = max(ranks)
        rank = bucket(top, self.rank_buckets) if top else 0
        few = bool(rank and self.few_adapters) and busy_segments(adapter_ids, size) <= self.few_adapters
        if rank and shapes.graph_few_stacked and self.stacks is not None:  # no scan of the adapters while off
            residents = step_residents(seqs)
            plan = stacked_plan(residents, shapes.graph_few_stacked, shapes.graph_stacked_held)
            if plan is not None:
                few = plan  # the graph key's LoRA plan: the stacked graph
                self.stacks.fill(plan.columns, residents, self.pool, plan.held)
        groups = lora_groups(ranks) if rank else NO_GROUPS
        ctx = self._context_bucket(max(s.num_computed + 1 for s in seqs))
        graph = self._graph(size, rank, ctx, few, groups)
        rows = [[s.tokens[-1] for s in seqs], [s.num_computed for s in seqs], [s.slots[s.num_computed] for s in seqs],
                [s.num_computed + 1 for s in seqs], [-1 if a is None else a for a in adapter_ids],
                [s.row for s in seqs]]
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
            # The first rows.shape[0] requests continue from the step before; any after them were admitted
            # with a one-token prompt, whose token the host staged above.
            ids, rows = device_tokens
            self.inputs[IDS, :rows.shape[0]].copy_(ids.index_select(0, rows))
        graph.replay()
        return self.logits[:n]
