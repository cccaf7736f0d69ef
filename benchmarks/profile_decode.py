"""Where a decode step's time goes: torch profiler table of GPU kernels for one batch size, base only and
with distinct adapters (Llama-2-7B shapes with LoRA on q,k,v,o, or Llama-3-8B shapes with LoRA on all seven
linears as in S-GQA; dummy weights, eager so every kernel is visible).

    python benchmarks/profile_decode.py --batch 128 --out profile.txt
    python benchmarks/profile_decode.py --model llama3-8b --batch 256 --prompt-len 384 --out profile-gqa.txt
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_decode import LLAMA2_7B, LLAMA3_8B, TARGETS, add_synthetic_adapters
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.model_config import ModelConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=["llama2-7b", "llama3-8b"], default="llama2-7b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--graphs", action="store_true", help="replay decode steps from CUDA graphs")
    p.add_argument("--few-adapters", type=int, default=EngineConfig.cuda_graph_few_adapters,
                   help="cuda_graph_few_adapters (graphs only; default the worker's)")
    p.add_argument("--kernel-shapes", default="", help="the worker's kernel_shapes (shared/kernel_shapes.py)")
    p.add_argument("--out", default="profile.txt")
    args = p.parse_args()
    cfg = ModelConfig.from_hf(LLAMA2_7B if args.model == "llama2-7b" else LLAMA3_8B)
    targets = TARGETS[args.model]
    engine = Engine.with_dummy_weights(cfg, EngineConfig(device="cuda", dtype="bfloat16", num_slots=0,
                                                         max_lora_rank=64,
                                                         max_running_requests=args.batch, max_batched_tokens=8192,
                                                         cuda_graphs=args.graphs,
                                                         # served batches (384, 512) run past the default 256
                                                         cuda_graph_max_batch=max(args.batch,
                                                                                  EngineConfig.cuda_graph_max_batch),
                                                         cuda_graph_few_adapters=args.few_adapters,
                                                         kernel_shapes=args.kernel_shapes,
                                                         overlap_steps=False))  # one step profiled at a time
    names = add_synthetic_adapters(engine, args.adapters, targets)
    report = []
    for label, used in (("base", []), ("lora", names)):
        for i in range(args.batch):
            engine.add_request(EngineRequest(f"{label}{i}", [5 + i % 100] * args.prompt_len,
                                             SamplingParams(max_tokens=64, ignore_eos=True), used[i % len(used)] if used else None))
        while any(s.remaining > 1 for s in engine.running) or engine.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        mode = "graphs" if args.graphs else "eager"
        report.append(f"== {args.model} {label} batch {args.batch}: {wall:.2f} ms/step (profiled, {mode})\n{table}")
        for seq in list(engine.running):
            engine.abort(seq.request_id)
        engine.step()
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
