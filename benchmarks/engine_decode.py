"""Decode step time of the engine on a GPU: base only vs 100 distinct adapters of mixed ranks, eager vs
CUDA graphs, at several batch sizes. Llama-2-7B shapes with dummy weights (no checkpoint needed).

    python benchmarks/engine_decode.py --out results.json [--batches 1,32,128,256]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from services.gpu_worker.adapter_layout import PackedAdapter, layout_offsets
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.model_config import MODULES, ModelConfig

LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
# The modules each model's benchmark adapters adapt: S2's q,k,v,o on Llama-2-7B, all seven linears on Llama-3-8B
# (S-GQA).
TARGETS = {"llama2-7b": ("q_proj", "k_proj", "v_proj", "o_proj"), "llama3-8b": tuple(MODULES)}


# GPU memory a benchmark's engine keeps free beside its pool and its synthetic adapters: CUDA graphs, a step's
# activations and the allocator's slack (an S2 engine at a batch of 384 captures a few GB of graphs).
GPU_RESERVE_BYTES = 8 << 30


def synthetic_adapter(name: str, cfg: ModelConfig, rank: int, targets: tuple[str, ...], device,
                      dtype: torch.dtype = torch.bfloat16) -> PackedAdapter:
    """Random rows already in pool format, made on the GPU (packing thousands of MB on the host is slow).

    Kept on the GPU while it has GPU_RESERVE_BYTES to spare beside them, else in pinned host memory, where a
    served worker's adapters wait too (loads are then host-to-device copies): an engine sized from free memory
    leaves ~15% of it, ~19 GB on an H200, which 300 adapters of S2's ranks (~63 MB each) would overrun."""
    ranks = tuple(rank if m in targets else 0 for m in MODULES)
    a_off, b_off, n_slots = layout_offsets(ranks, cfg, cfg.kv_dim)
    rows = torch.randn(cfg.num_layers, 2, n_slots, cfg.kv_dim, device=device, dtype=dtype) * 0.01
    if rows.is_cuda and torch.cuda.mem_get_info(rows.device)[0] < GPU_RESERVE_BYTES:
        rows = rows.cpu().pin_memory()
    return PackedAdapter(name, rows, ranks, a_off, b_off)


def add_synthetic_adapters(engine: Engine, count: int, targets: tuple[str, ...],
                           ranks: tuple[int, ...] = (8, 16, 32, 64)) -> list[str]:
    """`count` adapters a0, a1, ... in the engine's own store, ranks cycling over `ranks`; their names."""
    names = [f"a{i}" for i in range(count)]
    for i, name in enumerate(names):
        engine._local_adapters[name] = synthetic_adapter(name, engine.cfg, ranks[i % len(ranks)], targets,
                                                         engine.device, engine.dtype)
    return names


def measure(engine: Engine, batch: int, adapters: list[str], prompt_len: int, steps: int) -> dict:
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(3, engine.cfg.vocab_size) for _ in range(prompt_len)]
        adapter = adapters[i % len(adapters)] if adapters else None
        engine.add_request(EngineRequest(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=steps + 20, ignore_eos=True), adapter))
    while len(engine.running) < batch or any(s.remaining > 1 for s in engine.running):
        engine.step()  # prefill
    for _ in range(5):
        engine.step()  # warm-up (graph capture for this shape happens here)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    for seq in list(engine.running) + list(engine.waiting):
        engine.abort(seq.request_id)
    engine.step()
    return {"batch": batch, "step_ms": step_ms, "tok_per_s": batch / step_ms * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=["llama2-7b", "llama3-8b"], default="llama2-7b")
    p.add_argument("--batches", default="1,32,128,256")
    p.add_argument("--adapters", default="100",
                   help="distinct adapters of the LoRA batches, comma-separated for several (e.g. 5,100: with 5 a step "
                        "reads almost no adapter rows, so its cost over base is the LoRA path's fixed cost)")
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                   help="adapted modules, comma-separated, or all (the seven linears, as in S-GQA)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slots", type=int, default=120_000)
    p.add_argument("--modes", default="graphs,eager", help="graphs, eager or both")
    p.add_argument("--few-adapters", default=str(EngineConfig.cuda_graph_few_adapters),
                   help="graphs only: cuda_graph_few_adapters values to compare, comma-separated (0 = every graph "
                        "planned for all its segments; 32, the worker's default = steps of <= 32 adapters replay "
                        "graphs of their own)")
    p.add_argument("--segment-programs", type=int, default=EngineConfig.cuda_graph_segment_programs,
                   help="cuda_graph_segment_programs (default the worker's)")
    p.add_argument("--out", default="engine_decode.json")
    args = p.parse_args()
    cfg = ModelConfig.from_hf(LLAMA2_7B if args.model == "llama2-7b" else LLAMA3_8B)
    batches = [int(b) for b in args.batches.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(a) for a in args.adapters.split(",")]
    targets = tuple(MODULES) if args.targets == "all" else tuple(args.targets.split(","))
    results = []
    few_values = [int(f) for f in args.few_adapters.split(",")]
    engines = [(m == "graphs", few) for m in args.modes.split(",") for few in (few_values if m == "graphs" else [0])]
    for graphs, few in engines:
        config = EngineConfig(device="cuda", dtype="bfloat16", num_slots=args.slots, max_lora_rank=max(ranks),
                              max_running_requests=max(batches),
                              max_batched_tokens=8192, cuda_graphs=graphs, cuda_graph_max_batch=max(batches),
                              cuda_graph_few_adapters=few, cuda_graph_segment_programs=args.segment_programs,
                              overlap_steps=False)  # a step's own time, as the kernels' figures are
        engine = Engine.with_dummy_weights(cfg, config)
        names = []
        for i in range(max(counts)):
            name = f"adapter-{i:03d}"
            engine._local_adapters[name] = synthetic_adapter(name, cfg, ranks[i % len(ranks)],
                                                             targets, engine.device)
            names.append(name)
        for batch in batches:
            for label, used in (("base", []), *(("lora", names[:k]) for k in counts)):
                r = measure(engine, batch, used, args.prompt_len, args.steps)
                r.update(model=args.model, targets=list(targets), graphs=graphs, mode=label, adapters=min(len(used), batch),
                         few_adapters=few, segment_programs=args.segment_programs if few else 0)
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        del engine
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
