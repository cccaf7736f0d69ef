"""Does the order of an adapter's Bᵀ rows in the pool bound the many-adapter LoRA expand?

The pool stores a module's Bᵀ row by row, one slot (slot_width values) a rank row, so an expand program's
128-column tile gathers `rank` pieces of 256 bytes, each from another slot. Stored column tile first (a tile's
`rank` rows one after another), the same tile is one run of 2 to 16 KB. On the GPU the decode graph's q,k,v expand
over 300 adapters reads its rows at 0.55-0.71 of the copy rate and shrink, reading whole rows (8 KB runs), at
0.77-0.89 (docs/benchmarks.md, 2026-12-06).

Two expand kernels that differ only in where a tile's rows are read from, over the same adapters' rows (S2's
shapes: Llama-2-7B's q,k,v or o, ranks 64/32/16/8, a segment of tokens an adapter, as a decode or admission step
of `--batches` tokens over `--adapters` adapters), with the adapters' slots scattered over a pool four times their size (as a
pool long in use leaves them) or in one run (a fresh pool); GB/s of adapter rows read, beside a plain copy:

    python -m benchmarks.kernels.expand_layout_probe --out expand_layout_probe.json
    python -m benchmarks.kernels.expand_layout_probe --smoke --out /tmp/x.json   # CPU interpreter, checks only
    python -m benchmarks.kernels.expand_layout_probe --ptx-loads --out /tmp/x.json   # sm_90 global loads, no GPU
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from benchmarks.kernels.ceilings import copy_bandwidth_gbs
from benchmarks.kernels.timing import time_graph

RANKS = (64, 32, 16, 8)
TILE = 128  # columns of a run in the column-tile-first layout; a program's tile is --block-n, at most this
BLOCK_M = 16


@triton.jit
def _expand_probe_kernel(y_ptr, buf_ptr, slots_ptr, seg_start_ptr, seg_rank_ptr, seg_entry_ptr, out_ptr,
                         W, n_out, n_groups, n_tokens, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, TILES: tl.constexpr, TILED: tl.constexpr, RUN: tl.constexpr):
    """out[tokens of segment s, columns of group g] += y[g, tokens, :rank] @ Bᵀ tiles (y: [groups, T, BLOCK_R])."""
    s, g, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(seg_start_ptr + s)
    hi = tl.load(seg_start_ptr + s + 1)
    rank = tl.load(seg_rank_ptr + s)
    # The segment's adapter entries, then this group's: rank x (n_out / W) slots a module.
    entry = tl.load(seg_entry_ptr + s) + g * rank * (n_out // W)
    rows = tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    cols = tl.arange(0, BLOCK_N)
    for p0 in range(lo, hi, BLOCK_M):
        tok = p0 + tl.arange(0, BLOCK_M)
        t_mask = tok < hi
        y_ptrs = y_ptr + (g * n_tokens + tok).to(tl.int64)[:, None] * BLOCK_R + rows[None, :]
        y = tl.load(y_ptrs, mask=t_mask[:, None] & row_mask[None, :], other=0.0)
        for i in range(TILES):
            n0 = (c * TILES + i) * BLOCK_N
            if TILED:
                flat = (n0 // RUN) * rank * RUN + rows * RUN + n0 % RUN
            else:
                flat = rows * n_out + n0
            # A row's BLOCK_N values never straddle a slot: RUN divides W and BLOCK_N divides RUN. Both layouts
            # start a row's piece at a multiple of BLOCK_N within its slot; saying so keeps the loads 16 bytes wide
            # (the tiled offsets go through a runtime rank, where the compiler loses the alignment).
            slot = tl.load(slots_ptr + entry + flat // W, mask=row_mask, other=0)
            col0 = tl.multiple_of(flat % W, BLOCK_N)
            w = tl.load(buf_ptr + slot.to(tl.int64)[:, None] * W + col0[:, None] + cols[None, :],
                        mask=row_mask[:, None], other=0.0)
            o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * (n_groups * n_out) + g * n_out + n0 + cols[None, :]
            o = tl.load(o_ptrs, mask=t_mask[:, None], other=0.0)
            acc = tl.dot(y, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
            tl.store(o_ptrs, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=t_mask[:, None])


def layout_rows(b: torch.Tensor, tiled: bool, width: int) -> torch.Tensor:
    """One module's Bᵀ [rank, n_out] as the slots' rows [rank * n_out / width, width] in either order."""
    rank, n_out = b.shape
    if tiled:
        b = b.reshape(rank, n_out // TILE, TILE).transpose(0, 1)
    return b.reshape(-1, width)


class ProbeCase:
    """A step's segments over adapters of S2's ranks, their Bᵀ rows in two pools (one a layout)."""

    def __init__(self, batch: int, adapters: int, groups: int, n_out: int, width: int, scatter: bool,
                 dtype: torch.dtype, device: str, seed: int = 0):
        # The segments and slots drawn on the host, the values on the device (a step's worth of adapters' rows,
        # ~220 MB, takes seconds to draw on the host).
        gen, dgen = torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed)
        counts = torch.ones(adapters, dtype=torch.int64)
        counts += torch.bincount(torch.randint(0, adapters, (batch - adapters,), generator=gen), minlength=adapters)
        ranks = torch.tensor([RANKS[a % len(RANKS)] for a in range(adapters)], dtype=torch.int32)
        per_adapter = groups * ranks.long() * (n_out // width)
        entries = torch.zeros(adapters, dtype=torch.int64)
        entries[1:] = per_adapter.cumsum(0)[:-1]
        needed = int(per_adapter.sum())
        pool_slots = 4 * needed if scatter else needed
        slots = (torch.randperm(pool_slots, generator=gen)[:needed] if scatter else torch.arange(needed)).int()
        self.b = [[(torch.randn(int(r), n_out, generator=dgen, device=device) / 8).to(dtype) for _ in range(groups)]
                  for r in ranks]
        self.bufs = {}
        for tiled in (False, True):
            buf = torch.zeros(pool_slots, width, dtype=dtype, device=device)
            for a in range(adapters):
                mod_rows = torch.cat([layout_rows(b, tiled, width) for b in self.b[a]])
                buf[slots[entries[a]:entries[a] + per_adapter[a]].long().to(device)] = mod_rows
            self.bufs[tiled] = buf
        seg_start = torch.zeros(adapters + 1, dtype=torch.int32)
        seg_start[1:] = counts.cumsum(0)
        self.seg_start, self.ranks = seg_start.to(device), ranks.to(device)
        self.entries, self.slots = entries.int().to(device), slots.to(device)
        self.y = (torch.randn(groups, batch, max(RANKS), generator=dgen, device=device) / 8).to(dtype)
        self.out = torch.zeros(batch, groups * n_out, dtype=dtype, device=device)
        self.counts, self.groups, self.n_out, self.width = counts, groups, n_out, width
        self.rows_bytes = int(ranks.long().sum()) * groups * n_out * torch.finfo(dtype).bits // 8
        self._reference: torch.Tensor | None = None

    def launch(self, tiled: bool, tiles: int, block_n: int = TILE) -> None:
        grid = (self.counts.numel(), self.groups, self.n_out // (block_n * tiles))
        _expand_probe_kernel[grid](self.y, self.bufs[tiled], self.slots, self.seg_start, self.ranks, self.entries,
                                   self.out, self.width, self.n_out, self.groups, self.y.shape[1],
                                   BLOCK_M=BLOCK_M, BLOCK_R=max(RANKS), BLOCK_N=block_n, TILES=tiles, TILED=tiled,
                                   RUN=TILE)

    def reference(self) -> torch.Tensor:
        """The sums in fp32 on the case's device, once."""
        if self._reference is None:
            out = torch.zeros(self.out.shape, dtype=torch.float32, device=self.out.device)
            y = self.y.float()
            start = self.seg_start.tolist()
            for a, mods in enumerate(self.b):
                lo, hi = start[a], start[a + 1]
                for g, b in enumerate(mods):
                    out[lo:hi, g * self.n_out:(g + 1) * self.n_out] += y[g, lo:hi, :b.shape[0]] @ b.float()
            self._reference = out
        return self._reference


def ptx_loads(tiled: bool, block_n: int = TILE) -> dict[int, int]:
    """The global loads of one layout's kernel compiled for sm_90 (no GPU needed), by bytes a load. A fair probe gives
    both layouts the same: a layout whose row pieces the compiler cannot prove aligned is read 2 bytes a load."""
    import benchmarks.kernels.compile_report as report  # refuses the interpreter: it compiles real sm_90 code

    # A tiny case's launch, compiled as the compile report compiles any launch (its arguments specialised as on
    # the GPU: widths and token counts multiples of 16).
    case = ProbeCase(32, 8, 1, 2 * TILE, TILE, True, torch.bfloat16, "cpu")
    with report.compiling_launches() as results:
        case.launch(tiled, 1, block_n)
    return results.pop()["load_bytes"]


def check(case: ProbeCase, tiles: int, block_n: int) -> float:
    """Largest difference of either layout's output from the reference, relative to its largest magnitude."""
    ref = case.reference()
    worst = 0.0
    for tiled in (False, True):
        case.out.zero_()
        case.launch(tiled, tiles, block_n)
        worst = max(worst, float((case.out.float() - ref).abs().max() / ref.abs().max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="384,2926",
                        help="tokens of a step, comma list (384: S2's decode step at its batch; 2926: S2 n = 2000's "
                             "admission step, ~10 tokens a segment over 278 adapters)")
    parser.add_argument("--adapters", default="300,100", help="comma list")
    parser.add_argument("--groups", default="3,1", help="modules a launch adds to (3: q,k,v; 1: o), comma list")
    parser.add_argument("--tiles", default="1,2,4", help="column tiles a program walks, comma list")
    parser.add_argument("--block-n", type=int, default=TILE, choices=(32, 64, TILE),
                        help="columns a program's tile reads (under 128: several tiles a 128-column run)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, checks only")
    parser.add_argument("--ptx-loads", action="store_true",
                        help="only count each layout's global loads in its sm_90 code (no GPU, no interpreter)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.ptx_loads:
        loads = {"rows": ptx_loads(False, args.block_n), "tiled": ptx_loads(True, args.block_n)}
        print(json.dumps(loads), file=sys.stderr)
        with open(args.out, "w") as f:
            json.dump(loads, f, indent=1)
        return 0
    gpu = torch.cuda.is_available() and not args.smoke
    device = "cuda" if gpu else "cpu"
    # The interpreter's bf16 dot is wrong: the smoke run checks the addressing in fp32 at tiny widths.
    dtype, n_out, width = (torch.bfloat16, 4096, 4096) if gpu else (torch.float32, 256, 128)
    batches = [int(b) for b in args.batches.split(",")] if gpu else [24]
    adapter_counts = [int(a) for a in args.adapters.split(",")] if gpu else [12]
    results = {"gpu": torch.cuda.get_device_name() if gpu else "cpu", "rows": []}
    if gpu:
        results["copy_gbs"] = copy_bandwidth_gbs()
    cases = [(b, a, int(g), s) for b in batches for a in adapter_counts for g in args.groups.split(",")
             for s in (True, False) if b >= a]
    for i, (batch, adapters, groups, scatter) in enumerate(cases, 1):
        case = ProbeCase(batch, adapters, groups, n_out, width, scatter, dtype, device)
        for tiles in (int(t) for t in args.tiles.split(",")):
            if n_out % (args.block_n * tiles):
                continue
            err = check(case, tiles, args.block_n)
            row = {"batch": batch, "adapters": adapters, "groups": groups, "scatter": scatter, "tiles": tiles,
                   "block_n": args.block_n,
                   "max_rel_err": err, "rows_mb": case.rows_bytes / 1e6}
            for tiled in (False, True):
                ms = time_graph(lambda: case.launch(tiled, tiles, args.block_n), iters=50)
                row["tiled_us" if tiled else "rows_us"] = ms * 1e3
                row["tiled_gbs" if tiled else "rows_gbs"] = case.rows_bytes / (ms * 1e-3) / 1e9 if gpu else None
            print(f"[{i}/{len(cases)}] {json.dumps(row)}", file=sys.stderr, flush=True)
            results["rows"].append(row)
            if err > 2e-2:
                raise SystemExit(f"layouts disagree with the reference: {row}")
        del case
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
