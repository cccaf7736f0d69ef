"""Host time of a decode step beside its GPU time: replay-only timing of the step's CUDA graph, and a
cProfile of full engine steps (Llama-2-7B shapes, dummy weights).

    python benchmarks/host_overhead.py --batch 128 --out host.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks.engine_decode import LLAMA2_7B
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.model_config import ModelConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="1,128")
    p.add_argument("--out", default="host.txt")
    args = p.parse_args()
    cfg = ModelConfig.from_hf(LLAMA2_7B)
    engine = Engine.with_dummy_weights(cfg, EngineConfig(device="cuda", dtype="bfloat16", num_slots=60_000,
                                                         max_lora_rank=64, max_running_requests=256,
                                                         max_batched_tokens=8192,
                                                         overlap_steps=False))  # each step's host part, unhidden
    lines = []
    for batch in (int(b) for b in args.batches.split(",")):
        for i in range(batch):
            engine.add_request(EngineRequest(f"{batch}-{i}", [7 + i % 50] * 256, SamplingParams(max_tokens=80, ignore_eos=True)))
        while any(s.remaining > 1 for s in engine.running) or engine.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / 20 * 1e3
        graph = next(v for k, v in engine.graphs.graphs.items() if k[0] >= batch and k[1] == 0)  # (batch, rank, context) bucket
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t0) / 20 * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            engine.step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        lines.append(f"== batch {batch}: step {step_ms:.2f} ms, graph replay alone {replay_ms:.2f} ms\n{s.getvalue()}")
        for seq in list(engine.running):
            engine.abort(seq.request_id)
        engine.step()
    text = "\n".join(lines)
    open(args.out, "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
