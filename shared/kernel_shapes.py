"""The worker setting `kernel_shapes`: changes to the launch shapes the attention and LoRA expand launchers
choose, so a served point can try a shape the kernel benchmarks favoured before it becomes the default.
Shapes never change results: each one is tested to give the default launch's output. Parsed here, without
the kernels, so a launcher can reject a bad value before it starts any process.

Words, comma-separated:
  attention_block_n=N   context tokens a decode attention program loads at once (default: 128 for head_dim
                        <= 128): smaller blocks keep more programs resident on a multiprocessor
  attention_stages=N    pipeline stages of a decode attention program (default 3)
  attention_warps=N     warps of a decode attention program (default 4)
  heads_first           attention programs launched KV head first (AttentionConfig.heads_first); on by default
  split_mixed           a mixed step's decode rows launched apart from its prompts (attention's split_decode);
                        on by default
  expand_cols_first     LoRA expand programs launched column tile first (ExpandConfig.cols_first)
  graph_shrink_split=N  ways a decode graph planned for every segment splits LoRA shrink's inputs at least
                        (default 4; 1 keeps the split planned from the segment count alone)
  graph_expand_tiles=N  column tiles a LoRA expand program walks in a decode graph planned for every segment
                        (default 4 for groups of 64 column tiles or more, 2 for the others)
  graph_few_shrink_m=N  token rows a LoRA shrink tile holds in a decode graph of the few-adapter plan
                        (cuda_graph_few_adapters; default 16, at most 128): its segments average batch / 32
                        tokens or more, and a tile is one pass over the program's slice of adapter rows
  graph_few_shrink_long=N
                        in those graphs, a LoRA shrink program takes a segment of more than N tokens in 64-row
                        tiles and a shorter one in graph_few_shrink_m's, choosing on the device per segment
                        (default 16: on an H100 the engine's decode step took 0.94 of its time with one
                        height at 5 adapters, 0.96 at 12 and 1.01 at 32; docs/benchmarks.md, 2026-12-05
                        16:43); no_graph_few_shrink_long keeps one height for every segment
  graph_few_chunk=N     in those graphs, each LoRA shrink and expand program takes N-token chunks of the segments
                        it walks, so a long segment spreads over several programs (default: whole segments)
  graph_few_expand_deal in those graphs, the busy segments' 16-row token tiles are dealt to LoRA expand's programs
                        in turn instead of whole segments to each, so a long segment spreads over the programs
                        that would idle (off until timed on the H200)
  graph_few_shrink_deal the same for LoRA shrink's programs, its tiles of either height (off until timed)
  graph_few_deal_max=N  those two deal only while at most N segments are busy (default 8), and a step with more
                        walks them: on an H100 dealing took 3.7% off S-GQA's decode step over 5 adapters and
                        added 2.5% over 32 (docs/benchmarks.md, 2026-12-05 22:44); no_graph_few_deal_max deals
                        up to the graph's bound. The cap did not keep the walk's speed (2-3% lost at 12 and 32
                        adapters; the dealt shrink holds 176 registers a thread against 128 on either path), and
                        served S-GQA n = 5 gained nothing dealt (docs/benchmarks.md, 2026-12-06 03:18)
  graph_few_stacked=N   decode graphs of steps carrying at most N distinct adapters run their LoRA as dense
                        products (ops.stacked_lora: the adapters' rows side by side, one shrink GEMM over all of
                        them, one expand GEMM a module) instead of the segment kernels; N any count; the columns
                        are the adapters' widest ranks summed, bucketed to a power of two from 64 (default 8)
  graph_stacked_held=C  those graphs read the rows from buffers of their own, gathered from the pool when the
                        step's adapters change instead of every step; C (a power of two, 64 or more) columns at
                        most, and a step over more columns takes the segment kernels (default 256). The buffers
                        (C columns of every layer's A and Bᵀ rows: 1.34 GB for Llama-3-8B at 256) are taken when
                        the engine starts with graph_few_stacked on, before its pool is sized from the memory
                        left. On an H100, held, the decode step took 9.6% less at S-GQA's batch 512 over 5
                        adapters, 2.8% less at 256 over 8, 1.5% less at S2's 256 over 5, and served S-GQA n = 5
                        went from 43.91 to 45.94 req/s; gathered every step they gained 5% at 512 over 5 but lost
                        6.5% at 256 over 8 (docs/benchmarks.md, 2026-12-06 06:12)
  graph_batch_step=N    decode graphs are captured for batches every N rows past 256 (every min(N, 32) from 128
                        to 256; N a power of two, 8 to 64; default 64): a step replays the smallest graph holding
                        its rows, and its base GEMMs, bound by their FLOPs at served batches, compute the padding
                        rows too; a smaller N captures more graphs at warm-up. On an H100 Llama-2-7B's step of 336
                        rows took 1.1-1.6 ms less in a graph of 336 than of 384, Llama-3-8B's of 456 rows 0.5-0.7 ms
                        more in one of 464 than of 512 (docs/benchmarks.md, 2026-12-06 09:13); over 300 adapters
                        (S2 n = 2000's step) 332 rows took 1.0 ms less in a graph of 336, 300 rows 0.44 ms less
                        in one of 304, and Llama-3-8B's 456 rows over 100 the same in 464 as in 512; served S2
                        n = 5 at 256 the same as with the default (docs/benchmarks.md, 2026-12-06 22:33)
  expand_rank_whole     in a decode graph planned for every segment, a LoRA expand program takes its adapter's
                        whole rank in one step and pipelines over its column tiles (ExpandConfig.rank_whole);
                        off: S-GQA's decode step took 4.6% longer with it on the H200 (docs/benchmarks.md,
                        2026-12-04 19:22)
  expand_registers=N    registers a thread at most (ptxas's maxnreg, 24 to 255) for LoRA expand in a decode graph
                        planned for every segment and in a prefill's chunked launch of short segments (16-row
                        tiles; 64-row ones keep the compiler's choice) (default 56: on the H200 it
                        took 4-7% off those launches, the graph's q,k,v at batch 384 over 300 adapters 100.4 to
                        95.6 µs and an admission step's 151.1 to 141.7, docs/benchmarks.md, 2026-12-06 01:37; a
                        few-adapter graph's shared programs lost with it and keep the compiler's choice);
                        no_expand_registers leaves the compiler's choice everywhere
  no_<word>             turns off a word that is on by default, as no_split_mixed, or a number that is
                        (no_graph_few_shrink_long)

heads_first and split_mixed are on because the H200 measured them faster (docs/benchmarks.md, 2026-12-04 13:11):
decode attention 0.5-3.9% in all twelve served shapes, a mixed step's attention in 0.55-0.64 of one launch's time.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


# Words that take a register count (any number ptxas accepts), not a power of two.
REGISTER_WORDS = ("expand_registers",)
# Words that take a count of adapters, any positive number.
COUNT_WORDS = ("graph_few_stacked",)


@dataclass(frozen=True)
class LaunchShapes:
    attention_block_n: int = 0  # 0: the launcher's choice
    attention_stages: int = 0
    attention_warps: int = 0
    heads_first: bool = True
    split_mixed: bool = True
    expand_cols_first: bool = False
    graph_shrink_split: int = 0  # 0: the launcher's choice
    graph_expand_tiles: int = 0
    graph_few_shrink_m: int = 0
    graph_few_shrink_long: int = 16  # 0 (no_graph_few_shrink_long): one tile height for every segment
    graph_few_chunk: int = 0
    graph_few_expand_deal: bool = False
    graph_few_shrink_deal: bool = False
    graph_few_deal_max: int = 8  # 0 (no_graph_few_deal_max): up to the graph's bound on busy segments
    graph_few_stacked: int = 8  # 0 (no_graph_few_stacked): the segment kernels at every step
    graph_stacked_held: int = 256  # 0 (no_graph_stacked_held): a stacked graph gathers its rows every step
    graph_batch_step: int = 64  # rows between decode graphs' batch sizes past 256
    expand_rank_whole: bool = False
    expand_registers: int = 56  # 0 (no_expand_registers): the compiler's choice

    @classmethod
    def parse(cls, text: str) -> "LaunchShapes":
        values: dict = {}
        names = {f.name: f for f in fields(cls)}
        for word in (w.strip() for w in text.split(",")):
            if not word:
                continue
            name, eq, value = word.partition("=")
            on = True
            off = names.get(name[3:]) if name.startswith("no_") else None
            if off is not None and (off.type in ("bool", bool) or off.default):
                name, on = name[3:], False
            field = names.get(name)
            if field is None:
                raise ValueError(f"kernel_shapes: unknown word {name!r}; known: {', '.join(names)}")
            if not on and eq:
                raise ValueError(f"kernel_shapes: no_{name} takes no value, got {word!r}")
            if field.type in ("int", int) and not on:
                values[name] = 0  # a number on by default, turned off
            elif name in REGISTER_WORDS:
                if not eq or not value.isdigit() or not 24 <= int(value) <= 255:
                    raise ValueError(f"kernel_shapes: {name} needs a register count from 24 to 255, as {name}=56; "
                                     f"got {word!r}")
                values[name] = int(value)
            elif name in COUNT_WORDS:
                if not eq or not value.isdigit() or int(value) <= 0:
                    raise ValueError(f"kernel_shapes: {name} needs a count of adapters, as {name}=8; got {word!r}")
                values[name] = int(value)
            elif field.type in ("int", int):
                if not eq or not value.isdigit() or int(value) <= 0 or int(value) & (int(value) - 1):
                    raise ValueError(f"kernel_shapes: {name} needs a power of two, as {name}=64; got {word!r}")
                values[name] = int(value)
            else:
                if eq:
                    raise ValueError(f"kernel_shapes: {name} takes no value, got {word!r}")
                values[name] = on
        if values.get("attention_block_n", 16) < 16:
            raise ValueError("kernel_shapes: attention_block_n must be at least 16 (a tl.dot tile)")
        if not 16 <= values.get("graph_few_shrink_m", 16) <= 128:
            raise ValueError("kernel_shapes: graph_few_shrink_m must be 16 to 128 (a tl.dot tile, within shared memory)")
        if not 8 <= values.get("graph_batch_step", 64) <= 64:
            raise ValueError("kernel_shapes: graph_batch_step must be 8 to 64 rows")
        if 0 < values.get("graph_stacked_held", 0) < 64:
            raise ValueError("kernel_shapes: graph_stacked_held must be at least 64 columns (a stacked graph's fewest)")
        return cls(**values)
