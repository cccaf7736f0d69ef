"""The sm_90 compile report compiles real GPU code on a machine without one (Triton's bundled ptxas)."""
from __future__ import annotations

import subprocess
import sys

from bench import REPO
from benchmarks.kernels.load_widths import load_widths
from tests.benchmarks.sm90 import compile_env

# Compiles instead of launching, at Llama-3-8B shapes; the scripts below go on from it.
PRELUDE = """
import torch
import benchmarks.kernels.compile_report as cr
from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config
from services.gpu_worker import kernels
cr.triton_jit.JITFunction.run = cr._compile_instead_of_launch
cfg = llama_config("llama3-8b")
pool = AdapterPool(cfg, [8, 16, 32, 64], torch.bfloat16, "cpu")
"""

SCRIPT = PRELUDE + """
modules = GROUPS["gate_up"]
fan_in, out_dims = cfg.group_dims(modules)
token_adapter = (torch.arange(512, dtype=torch.int32) * 7) % 4
grouped = kernels.group_tokens_by_adapter(token_adapter, 100).kwargs()
y = torch.zeros(len(modules), 512, 64, dtype=torch.bfloat16)
out = torch.zeros(512, sum(out_dims), dtype=torch.bfloat16)
kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, config=cr.WHOLE_RANK, **grouped)
(r,) = cr.RESULTS
# 2-byte loads a thread makes past its share of the y tile's (BLOCK_M x BLOCK_R, read 2 bytes a load).
c = r["consts"]
narrow = r["load_bytes"].get(2, 0) - c["BLOCK_M"] * c["BLOCK_R"] // (32 * c["num_warps"])
print(r["kernel"], c["RANK_WHOLE"], narrow, r.get("REG"), r.get("LOCAL", 0), r.get("STACK", 0))
"""


def test_load_widths_count_plain_loads_and_asynchronous_copies_by_bytes():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd3 + 0 ];
    cp.async.cg.shared.global [ %r100 + 0 ], [ %rd58 + 0 ], 0x10, %r101;
    cp.async.ca.shared.global [ %r1 + 0 ], [ %rd5 + 0 ], 4;
    st.global.v4.b32 [ %rd9 + 0 ], { %r1, %r2, %r3, %r4 };
    """
    assert load_widths(ptx) == {2: 1, 4: 1, 8: 1, 16: 2}


def test_the_report_patches_the_launcher_modules_not_the_launcher_functions():
    env = compile_env()
    code = ("import types, benchmarks.kernels.compile_report as cr; "
            "print(all(isinstance(m, types.ModuleType) for m in (cr.lora_expand, cr.lora_shrink, cr.paged_attention)))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"]


def test_the_whole_rank_expand_compiles_for_sm90_without_spills():
    env = compile_env()
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    kernel, whole, narrow, regs, local, stack = run.stdout.split()
    assert (kernel, whole, local, stack) == ("_expand_segment_kernel", "True", "0", "0")
    # Its Bᵀ rows are read wide: offsets the compiler cannot prove aligned would add 64 2-byte loads a thread.
    assert int(narrow) <= 0
    assert 0 < int(regs) <= 255


LONG_TILES = PRELUDE + """
from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
from shared.kernel_shapes import LaunchShapes
modules = GROUPS["qkv"]
fan_in, out_dims = cfg.group_dims(modules)
token_adapter = (torch.arange(512, dtype=torch.int32) * 7) % 4
shared = {**kernels.group_tokens_by_adapter(token_adapter, 100, count_live=True).kwargs(),
          "live_segments": 32, "segment_programs": 32}
x = torch.zeros(512, fan_in, dtype=torch.bfloat16)
for words in ("no_graph_few_shrink_long", ""):
    set_launch_shapes(LaunchShapes.parse(words))
    kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64, **shared)
for r in cr.RESULTS:
    if r["kernel"] == "_shrink_segment_kernel":
        print(r["consts"]["BLOCK_M"], r["consts"]["BLOCK_M_LONG"], r.get("REG"), r.get("LOCAL", 0), r.get("STACK", 0))
"""


def compiled_rows(script: str) -> list[list[str]]:
    """The script's printed rows (launch constants, then registers, local memory and stack), each checked for
    spills."""
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=compile_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    for *_, regs, local, stack in rows:
        assert (local, stack) == ("0", "0") and 0 < int(regs) <= 255
    return rows


def test_the_few_adapter_shrink_with_both_tile_heights_compiles_for_sm90_without_spills():
    # A few-adapter graph's shrink (segments shared out among 32 programs), one tile height and two.
    rows = compiled_rows(LONG_TILES)
    assert [(m, long) for m, long, *_ in rows] == [("16", "0"), ("16", "64")]


DEALT = PRELUDE + """
from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
from shared.kernel_shapes import LaunchShapes
modules = GROUPS["gate_up"]
fan_in, out_dims = cfg.group_dims(modules)
token_adapter = (torch.arange(512, dtype=torch.int32) * 7) % 4
shared = {**kernels.group_tokens_by_adapter(token_adapter, count_live=True).kwargs(),
          "live_segments": 32, "segment_programs": 32}
y = torch.zeros(len(modules), 512, 64, dtype=torch.bfloat16)
out = torch.zeros(512, sum(out_dims), dtype=torch.bfloat16)
x = torch.zeros(512, fan_in, dtype=torch.bfloat16)
for words in ("", "graph_few_expand_deal,graph_few_shrink_deal"):
    set_launch_shapes(LaunchShapes.parse(words))
    kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64, **shared)
    kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, **shared)
for r in cr.RESULTS:
    if r["kernel"] in ("_shrink_segment_kernel", "_expand_segment_kernel"):
        print(r["kernel"][1:7], r["consts"]["DEAL"], r["consts"]["SEG_BLOCK"], r.get("REG"), r.get("LOCAL", 0),
              r.get("STACK", 0))
"""


def test_the_few_adapter_launches_with_their_tiles_dealt_compile_for_sm90_without_spills():
    # A few-adapter graph's shrink and expand (segments shared out among 32 programs), walking whole segments and
    # dealt, the busy segments' vectors holding graph_few_deal_max (8) of the graph's 32.
    rows = compiled_rows(DEALT)
    assert [tuple(row[:3]) for row in rows] == [("shrink", "False", "1"), ("expand", "False", "1"),
                                                ("shrink", "True", "8"), ("expand", "True", "8")]


CAPPED = PRELUDE + """
import dataclasses
from services.gpu_worker.kernels.lora_expand import choose_expand_config
modules = GROUPS["qkv"]
fan_in, out_dims = cfg.group_dims(modules)
token_adapter = (torch.arange(384, dtype=torch.int32) * 7) % 300
bound = kernels.group_tokens_by_adapter(token_adapter, count_live=True).kwargs()
bound.pop("num_live")
y = torch.zeros(len(modules), 384, 64, dtype=torch.bfloat16)
out = torch.zeros(384, sum(out_dims), dtype=torch.bfloat16)
chosen = choose_expand_config(384, len(modules), out_dims, pool.width, 64, torch.device("cpu"), True, None, 384)
caps = (0, 64, chosen.max_registers)  # the last: the launcher's own choice (kernel_shapes expand_registers)
for cap in caps:
    config = dataclasses.replace(chosen, max_registers=cap)
    kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, config=config, **bound)
for cap, r in zip(caps, cr.RESULTS):
    print(cap, r.get("REG"), r.get("LOCAL", 0), r.get("STACK", 0))
"""


def test_a_register_cap_reaches_ptxas():
    # A decode graph's many-adapter expand, as the compiler chooses and capped at 64 registers a thread (maxnreg):
    # the cap binds (the uncapped kernel needs more) and, at 64, spills nothing.
    run = subprocess.run([sys.executable, "-c", CAPPED], cwd=REPO, env=compile_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (_, free, *spill_free), (cap, capped, *spill_capped), (default, shipped, local, stack) = (
        line.split() for line in run.stdout.splitlines())
    assert spill_free == spill_capped == ["0", "0"]
    assert cap == "64" and int(capped) <= 64 < int(free)
    # The launcher's default cap (56) binds too; it keeps a small stack frame (8-16 bytes on sm_90), never a
    # spill to local memory.
    assert default == "56" and int(shipped) <= 56 and local == "0" and int(stack) <= 32
