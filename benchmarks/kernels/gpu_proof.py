"""The kernels' GPU proof in one run: ceilings, bf16 correctness at Llama shapes, LoRA and attention
microbenchmarks, launch-shape sweeps. Writes kernels.json (everything), kernels.md (tables) and PNG plots
to the output folder; prints the tables last.

    python -m benchmarks.kernels.gpu_proof --out DIR            # on the GPU
    python -m benchmarks.kernels.gpu_proof --out DIR --smoke    # CPU, Triton interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.kernels import bench_attention, bench_lora, ceilings, correctness  # noqa: E402
from benchmarks.kernels.report import write_plots, write_tables  # noqa: E402


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "command": " ".join(["python -m benchmarks.kernels.gpu_proof"] + sys.argv[1:])}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return env


# (slot_run, pool_slots) of the served attention rows: single-token pages in the batch's own pool (as the kernel
# table) and in a served S2 pool's 219k slots (a layer's K/V over 3.6 GB), and 16-token runs in the latter (what a
# request's slots would look like if its decode slots were handed out 16 at a time).
SERVED_LAYOUTS = ((1, 0), (1, 219_000), (16, 219_000))
SMOKE_LAYOUTS = ((1, 0), (4, 200))
# worker.kernel_shapes values timed on the served decode batches. Programs of a served step walk ~400 tokens
# each: smaller blocks keep two or more programs resident on a multiprocessor, so one's first loads overlap
# another's last; heads first (the default) has programs side by side read the same slots' rows.
SERVED_SHAPES = ("attention_block_n=64", "attention_block_n=64,attention_stages=4",
                 "attention_block_n=32,attention_stages=4", "attention_block_n=64,attention_warps=2", "no_heads_first",
                 "no_heads_first,attention_block_n=64")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    ap.add_argument("--only", default="", help="comma list of sections to run (default all)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16  # bf16 tl.dot is wrong in the interpreter
    big, gqa = ("tiny", "tiny") if smoke else ("llama2-7b", "llama3-8b")
    batches = [1, 5] if smoke else [1, 4, 16, 64, 128, 256, 512]
    contexts = [40] if smoke else [512, 1024, 2048, 4096, 8192]
    layers = 2 if smoke else 8
    n_adapters = 6 if smoke else 100
    results: dict = {"env": environment(), "errors": {}}

    def attention_variants(c):
        return {"block_n 64": replace(c, block_n=64), "stages 2": replace(c, num_stages=2),
                "split x2": replace(c, n_split=c.n_split * 2), "split /2": replace(c, n_split=max(1, c.n_split // 2)),
                "warps 8": replace(c, num_warps=8), "heads order flipped": replace(c, heads_first=not c.heads_first),
                "heads order flipped split /2": replace(c, heads_first=not c.heads_first,
                                                        n_split=max(1, c.n_split // 2))}

    sections = {
        "ceilings": lambda: {"copy_gbs": ceilings.copy_bandwidth_gbs(), "matmul_tflops": ceilings.matmul_tflops()},
        "correctness": lambda: (correctness.run_all(dtype, device, models=(big,) if smoke else None)
                                + [{"check": "bmm baseline agrees with ours", "model": big, "tokens": 48,
                                    "rel_err": bench_lora.check_baselines_agree(big, dtype=dtype, device=device),
                                    "ok": None}]),
        "lora": lambda: (bench_lora.bench_group(big, "qkv", batches, n_adapters, layers, dtype=dtype, device=device)
                         + bench_lora.bench_group(big, "gate_up", batches, n_adapters, layers, dtype=dtype,
                                                  device=device)),
        # S-GQA's widest group too: its expand is most of a Llama-3-8B decode step's LoRA time.
        "lora_sweep": lambda: [r for m, g, t in ([(big, "qkv", 5)] if smoke else
                                                 [(big, "qkv", 64), (big, "qkv", 256), (gqa, "qkv", 64),
                                                  (gqa, "gate_up", 256)])
                               for r in bench_lora.sweep_launch_shapes(m, g, t, n_adapters, layers,
                                                                       dtype=dtype, device=device)],
        "attention": lambda: [r for m in (big, gqa)
                              for r in bench_attention.bench_decode(m, contexts, dtype, attention_variants,
                                                                    device=device,
                                                                    min_bytes=1 if smoke else 256 << 20)],
        "attention_served": lambda: [r for m, bs in ((big, [4] if smoke else [256, 384]),
                                                    (gqa, [4] if smoke else [256, 512]))
                                     for r in bench_attention.bench_decode_served(
                                         m, bs, dtype, SERVED_SHAPES, device=device,
                                         prompt_range=(4, 20) if smoke else (8, 512),
                                         output_range=(4, 20) if smoke else (8, 512),
                                         layouts=SMOKE_LAYOUTS if smoke else SERVED_LAYOUTS)],
        "attention_mixed": lambda: [bench_attention.bench_mixed(m, running, prompts, dtype, device=device,
                                                                prompt_range=(4, 20) if smoke else (8, 512),
                                                                output_range=(4, 20) if smoke else (8, 512))
                                    for m, running, prompts in (((big, 4, 2), (gqa, 4, 2)) if smoke else
                                                                ((big, 376, 10), (big, 250, 16), (gqa, 500, 12)))],
        "prefill": lambda: [bench_attention.bench_prefill(m, 2 if smoke else 4, 20 if smoke else 2048, dtype, device)
                            for m in (big, gqa)],
    }
    if smoke:
        sections.pop("ceilings")
    only = [s for s in args.only.split(",") if s]
    # Headline numbers first, so a run cut short still has them.
    order = ["ceilings", "correctness", "attention", "attention_served", "attention_mixed", "lora", "prefill",
             "lora_sweep"]
    for name in order:
        fn = sections.get(name)
        if fn is None or (only and name not in only):
            continue
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception:
            results["errors"][name] = traceback.format_exc()[-3000:]
            print(f"section {name} failed:\n{results['errors'][name]}", flush=True)
        results.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
        print(f"section {name}: {results['section_seconds'][name]} s", flush=True)
        (out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))
    tables = write_tables(results)
    (out / "kernels.md").write_text(tables)
    try:
        write_plots(results, out)
    except ImportError as exc:
        print(f"no plots: {exc}")
    print(tables)


if __name__ == "__main__":
    main()
