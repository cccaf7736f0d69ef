"""Decode step time under S-LoRA tensor parallelism: TP=1 vs TP=N on one host, base only and with
adapters, Llama-2-7B shapes, dummy weights, eager steps (decode graphs are off under TP).

    python benchmarks/tp_decode.py --tp 1,2 --batches 32,128 --out tp.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.engine_decode import LLAMA2_7B, measure
from services.gpu_worker.adapter_layout import PackedAdapter, layout_offsets
from services.gpu_worker.tp.engine import TPEngine
from shared.config import EngineConfig
from shared.model_config import MODULES, ModelConfig


def host_adapter(name: str, cfg: ModelConfig, rank: int) -> PackedAdapter:
    ranks = tuple(rank if m in ("q_proj", "k_proj", "v_proj", "o_proj") else 0 for m in MODULES)
    a_off, b_off, n_slots = layout_offsets(ranks, cfg, cfg.kv_dim)
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn(cfg.num_layers, 2, n_slots, cfg.kv_dim, generator=gen) * 0.01
    return PackedAdapter(name, rows, ranks, a_off, b_off)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", default="1,2")
    p.add_argument("--batches", default="32,128")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="tp_decode.json")
    args = p.parse_args()
    cfg = ModelConfig.from_hf(LLAMA2_7B)
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        config = EngineConfig(device="cuda", dtype="bfloat16", num_slots=60_000, max_lora_rank=64,
                              max_resident_adapters=args.adapters + 4, max_running_requests=max(batches),
                              max_batched_tokens=8192, cuda_graphs=False)
        engine = TPEngine.with_dummy_weights(cfg, config, tp_size=tp)
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            engine._registered[name] = host_adapter(name, cfg, (8, 16, 32, 64)[i % 4])
        for batch in batches:
            for label, used in (("base", []), ("lora", names)):
                r = measure(engine, batch, used, 256, args.steps)
                traffic = getattr(engine, "last_step_traffic", None)
                r.update(tp=tp, mode=label, traffic=str(traffic) if traffic is not None else None)
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        engine.shutdown()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
