"""Compile every kernel for sm_90 (H100/H200) on a machine without a GPU, through the real launchers at
Llama shapes, and report registers, spills and shared memory per specialisation.

Catches compile errors and local-memory spills before spending device time. Uses Triton's bundled ptxas
and cuobjdump; launches nothing. Each line also counts the global loads by width.
Usage: python -m benchmarks.kernels.compile_report
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles real GPU code")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402

from benchmarks.kernels.load_widths import load_widths  # noqa: E402
from benchmarks.kernels.shapes import GROUPS, AdapterPool, llama_config, paged_kv  # noqa: E402
from services.gpu_worker import kernels  # noqa: E402
from services.gpu_worker.kernels.launch_shapes import set_launch_shapes  # noqa: E402
from shared.kernel_shapes import LaunchShapes  # noqa: E402

# The modules themselves: the package's names lora_expand and lora_shrink are the launcher functions.
lora_expand, lora_shrink, paged_attention = (importlib.import_module(f"services.gpu_worker.kernels.{name}")
                                             for name in ("lora_expand", "lora_shrink", "paged_attention"))

TARGET = GPUTarget("cuda", 90, 32)
WHOLE_RANK = lora_expand.ExpandConfig(block_r=64, block_n=128, tiles_per_prog=4, rank_whole=True)
RESULTS: list[dict] = []
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return found


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    backend = make_backend(TARGET)
    kwargs["debug"] = False
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    binder = triton_jit.create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton_compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    consts = {k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")}
    RESULTS.append({"kernel": self.__name__, "grid": tuple(grid), **_resources(compiled.asm["cubin"]),
                    "smem_meta": compiled.metadata.shared, "consts": consts,
                    "load_bytes": load_widths(compiled.asm["ptx"])})
    return None


@contextlib.contextmanager
def compiling_launches():
    """Inside, every Triton launch compiles for sm_90 into RESULTS instead of running; the launcher comes back
    after."""
    launch = triton_jit.JITFunction.run
    triton_jit.JITFunction.run = _compile_instead_of_launch
    try:
        yield RESULTS
    finally:
        triton_jit.JITFunction.run = launch


def launch_everything(dtype=torch.bfloat16) -> None:
    """The launches the GPU proof makes, at the same shapes (kernels compile, nothing runs)."""
    for model in ("llama2-7b", "llama3-8b"):
        cfg = llama_config(model)
        pool = AdapterPool(cfg, [8, 16, 32, 64], dtype, "cpu")
        for modules in GROUPS.values():
            fan_in, out_dims = cfg.group_dims(modules)
            for num_tokens in (1, 4, 16, 64, 128, 256, 512):
                token_adapter = (torch.arange(num_tokens, dtype=torch.int32) * 7) % 4
                x = torch.zeros(num_tokens, fan_in, dtype=dtype)
                out = torch.zeros(num_tokens, sum(out_dims), dtype=dtype)
                grouped = kernels.group_tokens_by_adapter(token_adapter, 100).kwargs()
                # The last: as a decode graph may launch them, segments shared out among 32 programs.
                shared = {**kernels.group_tokens_by_adapter(token_adapter, 100, count_live=True).kwargs(),
                          "live_segments": 16, "segment_programs": 32}
                for kwargs in ({}, grouped, shared):
                    y = kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64, **kwargs)
                    kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, **kwargs)
                if num_tokens == 512:  # the whole-rank expand (kernel_shapes expand_rank_whole), as a graph's
                    kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims,
                                        config=WHOLE_RANK, **grouped)
                    # A few-adapter graph's shrink and expand with their token tiles dealt (kernel_shapes
                    # graph_few_shrink_deal, graph_few_expand_deal).
                    set_launch_shapes(LaunchShapes.parse("graph_few_expand_deal,graph_few_shrink_deal"))
                    try:
                        y = kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64, **shared)
                        kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, **shared)
                    finally:
                        set_launch_shapes(LaunchShapes())
            seg = dict(seg_start=torch.tensor([0, 700, 1024], dtype=torch.int32),
                       seg_adapter=torch.tensor([1, 3], dtype=torch.int32), max_seg_len=700)
            token_adapter = torch.tensor([1] * 700 + [3] * 324, dtype=torch.int32)
            x = torch.zeros(1024, fan_in, dtype=dtype)
            out = torch.zeros(1024, sum(out_dims), dtype=dtype)
            y = kernels.lora_shrink(x, pool.k(), token_adapter, pool.tables, modules, 64, **seg)
            kernels.lora_expand(y, pool.v(), token_adapter, pool.tables, modules, out, out_dims, **seg)
        for q_lens, ctx_lens in (([1] * 32, [2048] * 32), ([1] * 4, [512] * 4), ([2048] * 2, [2048] * 2)):
            kv, meta = paged_kv(cfg, q_lens, ctx_lens, dtype, "cpu")
            q = torch.zeros(sum(q_lens), cfg.num_heads, cfg.head_dim, dtype=dtype)
            kernels.attention(q, kv[0], kv[1], meta, cfg.head_dim ** -0.5)
        kernels.write_kv(kv[0], kv[1], torch.arange(8, dtype=torch.int32), kv[0][:8].clone(), kv[1][:8].clone())


def main() -> None:
    for module in (lora_shrink, lora_expand, paged_attention):
        module.num_sms = lambda device: 132  # launch shapes as on an H200
    with compiling_launches():
        launch_everything()
    seen = set()
    for r in RESULTS:
        key = (r["kernel"], repr(r["consts"]))
        if key in seen:
            continue
        seen.add(key)
        flag = "  <-- SPILLS" if r.get("LOCAL", 0) or r.get("STACK", 0) else ""
        print(f"{r['kernel']:<24} regs={r.get('REG')} stack={r.get('STACK')} local={r.get('LOCAL')} "
              f"smem={r['smem_meta']} loads(bytes:count)={r['load_bytes']} {r['consts']}{flag}")


if __name__ == "__main__":
    main()
