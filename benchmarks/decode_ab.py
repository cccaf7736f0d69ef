"""One decode step under two or more launch-shape settings (the worker's kernel_shapes), timed on one engine
in alternating rounds, so the machine's drift over a run (clocks, heat: 1-2% on every kernel between two
profiles minutes apart on the H200) falls on all alike. Rounds go A B, B A, A B, ... (with more settings,
A B C, C B A, ...); each setting keeps its own CUDA graphs, captured at its first round and left out of the
timing. Each further --b is another setting (C, D, ...) on the same engine: one model load and prefill for all.

    python benchmarks/decode_ab.py --model llama3-8b --batch 512 --adapters 100 --prompt-len 384 \
        --a graph_expand_tiles=2 --b "" --out ab.json
    python benchmarks/decode_ab.py --smoke --out /tmp/ab.json   # CPU, tiny model: checks the script runs

The result: each setting's milliseconds a step per round, their medians, and the median of the paired
differences against A (each round's B against the A next to it; `median_minus_a_ms` and `over_a` for every
setting, `median_b_minus_a_ms` and `b_over_a` for B).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.engine_decode import LLAMA2_7B, LLAMA3_8B, TARGETS, add_synthetic_adapters
from services.gpu_worker.cuda_graphs import context_bucket
from services.gpu_worker.engine import Engine
from services.gpu_worker.kernels.launch_shapes import set_launch_shapes
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.kernel_shapes import LaunchShapes
from shared.model_config import MODULES, ModelConfig
from shared.tiny_model import VOCAB_SIZE, hf_config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_one_context_bucket(longest: int, steps: int, max_len: int) -> None:
    """Raise unless a run of `steps` decode steps from a longest context of `longest` stays in one context
    bucket: a step past it replays graphs of the next bucket, captured inside a timed round."""
    first, last = context_bucket(longest, max_len), context_bucket(longest + steps, max_len)
    if first != last:
        raise ValueError(f"the longest context goes from {longest} to {longest + steps} tokens over the run, past the "
                         f"graphs' {first}-token context bucket: shorten --prompt-len or the rounds")


def check_no_preemption(engine: Engine, args, decode_steps: int) -> None:
    """Raise once the pool has run out of KV slots for the batch: preempted requests are prefilled again and
    preempt others in turn, so the run would spin until it is killed (Llama-2-7B at a batch of 384 on 80 GB)."""
    if engine.num_preemptions:
        raise SystemExit(
            f"the pool's {engine.pool.num_slots} slots cannot hold {args.batch} requests of {args.prompt_len} prompt "
            f"tokens and {decode_steps} decode steps beside the adapters ({engine.num_preemptions} preempted while "
            f"prefilling): lower --batch or --prompt-len, or run on a GPU with more memory")


def build(args) -> tuple[Engine, list[str]]:
    if args.smoke:  # the tiny test model's shapes, every module adapted
        cfg, targets, device, dtype, graphs = ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE)), tuple(MODULES), \
            "cpu", "float32", False
    else:
        cfg = ModelConfig.from_hf(LLAMA2_7B if args.model == "llama2-7b" else LLAMA3_8B)
        targets, device, dtype, graphs = TARGETS[args.model], "cuda", "bfloat16", True
    engine = Engine.with_dummy_weights(cfg, EngineConfig(
        device=device, dtype=dtype, num_slots=args.slots or (4096 if args.smoke else 0), max_lora_rank=64, max_running_requests=max(args.batch, args.max_batch),
        max_batched_tokens=8192, cuda_graphs=graphs,
        cuda_graph_max_batch=max(args.batch, args.max_batch or EngineConfig.cuda_graph_max_batch),
        kernel_shapes=args.a, overlap_steps=False))  # one step timed at a time
    return engine, add_synthetic_adapters(engine, args.adapters, targets)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama2-7b", "llama3-8b"], default="llama2-7b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--adapters", type=int, default=100, help="distinct adapters, one per request in turn (0: base only)")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--a", default="", help="kernel_shapes of setting A (empty: the defaults)")
    p.add_argument("--b", action="append", default=None,
                   help="kernel_shapes of setting B (empty: the defaults); again for C, D, ...")
    p.add_argument("--max-batch", type=int, default=0,
                   help="the graphs' largest batch (cuda_graph_max_batch, as a served stack sets it; 0: the default, "
                        "or --batch if larger): a batch below it replays the bucket holding it")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="decode steps timed a round")
    p.add_argument("--out", required=True)
    p.add_argument("--slots", type=int, default=0,
                   help="the pool's slots (0: the engine sizes it from free memory; 4096 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, no graphs: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.adapters, args.prompt_len, args.rounds, args.steps = 4, 3, 8, 2, 2
    others = args.b if args.b is not None else [""]
    words = {"A": args.a, **{chr(ord("B") + i): text for i, text in enumerate(others)}}
    settings = {label: LaunchShapes.parse(text) for label, text in words.items()}  # a bad word fails here
    labels = list(settings)
    engine, names = build(args)
    # Every request lasts the whole run (the batch never shrinks to another graph's size), counting the decode
    # steps the first admitted run during the others' prefill (at most one a prefill step, at most one prefill
    # step a request). Each round also runs one untimed step after switching settings (a first capture falls
    # there).
    decode_steps = args.rounds * len(labels) * (args.steps + 1) + 2
    for i in range(args.batch):
        engine.add_request(EngineRequest(f"r{i}", [5 + i % 100] * args.prompt_len,
                                         SamplingParams(max_tokens=decode_steps + args.batch + 8, ignore_eos=True),
                                         names[i % len(names)] if names else None))
    while len(engine.running) < args.batch or any(s.remaining > 1 for s in engine.running):
        engine.step()  # prefill
        check_no_preemption(engine, args, decode_steps)
    longest = max(s.num_computed + 1 for s in engine.running)
    check_one_context_bucket(longest, decode_steps, engine.page_table.max_len)
    for _ in range(2):
        engine.step()
    graphs = {label: {} for label in labels}
    graphs["A"] = engine.graphs.graphs if engine.graphs is not None else None
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            set_launch_shapes(settings[label])
            if engine.graphs is not None:
                engine.graphs.graphs = graphs[label]
            engine.step()  # untimed: this setting's graph for the shape may be captured here
            sync(engine.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync(engine.device)
            times[label].append((time.perf_counter() - t0) / args.steps * 1e3)
            if len(engine.running) != args.batch:
                raise RuntimeError(f"{len(engine.running)} requests running after round {r + 1}, not {args.batch}")
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{label} {times[label][-1]:.3f} ms" for label in labels)
              + " a step", file=sys.stderr, flush=True)
    set_launch_shapes(LaunchShapes())
    medians = {k: statistics.median(v) for k, v in times.items()}
    minus_a = {k: statistics.median([x - a for a, x in zip(times["A"], v)]) for k, v in times.items() if k != "A"}
    over_a = {k: medians[k] / medians["A"] for k in minus_a}
    result = {"model": "tiny" if args.smoke else args.model, "batch": args.batch, "adapters": args.adapters,
              "prompt_len": args.prompt_len, "longest_context": [longest, longest + decode_steps], "a": args.a,
              "b": others[0], "settings": words, "rounds": args.rounds, "steps": args.steps,
              "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "step_ms": times, "median_ms": medians, "median_minus_a_ms": minus_a,
              "over_a": over_a, "median_b_minus_a_ms": minus_a["B"], "b_over_a": over_a["B"],
              "max_batch": engine.graphs.max_batch if engine.graphs is not None else None,
              # The batch buckets each setting's graphs replayed (kernel_shapes graph_batch_step sets them).
              "graph_batches": {k: sorted({key[0] for key in g}) for k, g in graphs.items() if g is not None}}
    # What a decode step's LoRA kernels must read (the same under both settings): over the copy ceiling, the
    # floor of their share of the step.
    stats = engine.step_stats
    decode_steps_run = stats.steps["graph"] + stats.steps["decode"]
    result["adapters_a_step"] = (stats.adapters["graph"] + stats.adapters["decode"]) / decode_steps_run
    rows_bytes = stats.adapter_bytes["graph"] + stats.adapter_bytes["decode"]
    result["adapter_rows_gb_a_step"] = rows_bytes / decode_steps_run / 1e9
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"A ({args.a or 'defaults'}) {medians['A']:.3f} ms a step; "
          + "; ".join(f"{k} ({words[k] or 'defaults'}) {medians[k]:.3f} ms, {k} - A {minus_a[k]:+.3f} ms (median of "
                      f"{args.rounds} paired rounds), {k} / A {over_a[k]:.4f}" for k in minus_a)
          + f"; each step read {result['adapters_a_step']:.1f} adapters' rows, "
          f"{result['adapter_rows_gb_a_step']:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
