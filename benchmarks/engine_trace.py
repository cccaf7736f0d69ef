"""Saturation throughput of the engine alone on S-LoRA's workload (no HTTP, no services): every request
of a trace is queued at once, the engine runs until `--seconds` pass, and the step mix is reported
(decode steps replayed from CUDA graphs vs eager steps that carry prefill), so the serving ceiling of one
GPU and where its time goes are known before the whole stack is measured. Each kind of step also reports
how long the host took to launch it (`*_launch_ms`): a launch nearly as long as the step means the GPU waited
on the host issuing kernels, a short one that the step is bound by its kernels. `steps` gives each kind of
step over the measured window with the distinct adapters a mean step read and its floor (bench/step_floor.py:
its own work with every operation at the ceiling that binds it, ceilings measured before the engine is built,
in a process of their own, as a sweep measures them before its stacks), to set beside a served point's
`worker_steps`.

    python benchmarks/engine_trace.py --adapters 100 --seconds 40 --out trace.json

`kernel_builds_window` counts the Triton kernel variants built inside the window, by kernel, with their seconds
with the first variants of each (services/gpu_worker/kernel_builds.py): a build stalls the host issuing a step
while the GPU waits. `steps` gives them by kind too (`builds`, `build_s`).

`--profile-steps N --profile-out FILE` then runs N more steps under the torch profiler and writes their GPU
kernels as a table: a served step's kernels at the trace's own rows, contexts and adapters (the graphs' padding
rows, a context bucket over mixed lengths, admission steps between decode steps), to set beside
benchmarks/profile_decode.py's uniform batch. Only the kernels' times are read: the profiler slows the host
far more than the GPU (202 ms a step of wall time against 36.5 ms of kernels, S-GQA on an H100).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import sys
import time
from dataclasses import fields

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.driver import measure_ceilings_apart
from bench.roofline import Ceilings
from bench.settings import ATTENTION, get_setting
from bench.step_floor import setting_of, window_steps, with_floors
from benchmarks.engine_decode import LLAMA2_7B, LLAMA3_8B, TARGETS, synthetic_adapter
from services.gpu_worker.engine import Engine
from services.gpu_worker.kernel_builds import watch_builds
from services.gpu_worker.warmup import warm_up, warmup_adapters
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig, add_config_arguments
from shared.model_config import ModelConfig
from shared.tiny_model import VOCAB_SIZE, hf_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=["llama2-7b", "llama3-8b"], default="llama2-7b")
    p.add_argument("--adapters", type=int, default=100, help="0 = base model only")
    p.add_argument("--ranks", default="64,32,16,8")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    # Every other engine setting as the worker's own flag (e.g. --no-overlap-steps, --admission-batch 1), with
    # the worker's defaults: max_resident_adapters among them, since it bounds the segments the LoRA kernels
    # launch in a decode graph, so a trace launches what a serving worker launches.
    set_here = ("device", "dtype", "num_slots", "max_lora_rank", "max_running_requests",
                "max_batched_tokens", "cuda_graph_max_batch")
    add_config_arguments(p.add_argument_group("engine"), EngineConfig, skip=set_here)
    p.add_argument("--out", default="engine_trace.json")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the window, this many steps under the torch profiler (0: none)")
    p.add_argument("--profile-out", default="", help="where the profiled steps' kernel table goes")
    p.add_argument("--worker-warmup", action="store_true",
                   help="run the worker's own warm-up (services/gpu_worker/warmup.py) before the trace, as a served "
                        "worker does before it reports ready; its builds are reported apart")
    p.add_argument("--host-profile-steps", type=int, default=0,
                   help="after the window, this many steps under cProfile: where the host's time goes (0: none)")
    p.add_argument("--host-profile-out", default="", help="where the host profile's table goes")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few seconds: checks the script runs")
    args = p.parse_args()
    if args.profile_steps and not args.profile_out:
        p.error("--profile-steps needs --profile-out")
    if args.host_profile_steps and not args.host_profile_out:
        p.error("--host-profile-steps needs --host-profile-out")
    if args.smoke:  # the tiny test model's shapes on q,k,v,o, as the `tiny` setting
        cfg, targets, device, dtype = ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE)), ATTENTION, "cpu", "float32"
        args.ranks, args.max_running, args.max_batched_tokens = "8,4", min(args.max_running, 8), 256
    else:
        cfg = ModelConfig.from_hf(LLAMA2_7B if args.model == "llama2-7b" else LLAMA3_8B)
        targets, device, dtype = TARGETS[args.model], "cuda", "bfloat16"
    ranks = [int(r) for r in args.ranks.split(",")]
    extra = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in set_here}
    config = EngineConfig(device=device, dtype=dtype, num_slots=4096 if args.smoke else 0, max_lora_rank=max(ranks),
                          max_running_requests=args.max_running,
                          max_batched_tokens=args.max_batched_tokens, cuda_graph_max_batch=args.max_running,
                          **extra)
    # Before the engine, in a child process: measured after a run, with the engine's memory given back, the
    # copy ceiling read 3.79 TB/s on the H200 where sweeps read 4.09-4.20 before their stacks (2026-12-05), so
    # floors here and in served lines were read at different rates.
    ceilings = Ceilings(**measure_ceilings_apart(device))
    builds = watch_builds()  # the engine's own watcher, whose counts hold its warm-up's builds too
    engine = Engine.with_dummy_weights(cfg, config)
    worker_warmup = None
    if args.worker_warmup:
        # What a served worker runs before it reports ready: the window's builds are then the ones a served
        # point's traffic would meet after it.
        packed = warmup_adapters(cfg, engine.dtype, config.max_lora_rank)
        engine._local_adapters.update(packed)
        started, built = time.perf_counter(), builds.snapshot()
        warm_up(engine, cfg, adapters=list(packed))
        worker_warmup = {"seconds": round(time.perf_counter() - started, 3), "kernel_builds": builds.summary(built)}
    rng = np.random.default_rng(0)
    names = []
    for i in range(args.adapters):
        name = f"adapter-{i:04d}"
        engine._local_adapters[name] = synthetic_adapter(name, cfg, int(rng.choice(ranks)), targets, engine.device,
                                                         engine.dtype)
        names.append(name)
    for i in range(args.requests):
        longest = 64 if args.smoke else 512  # the tiny model's context is short
        prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(8, longest))).tolist()
        adapter = names[int(rng.integers(0, len(names)))] if names else None
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(8, longest)),
                                                                         ignore_eos=True), adapter))
    # Warm-up: the first steps compile kernels, capture graphs and load adapters, and the batch fills from the
    # queue in admission rounds; measure once --warmup seconds have passed and the batch has been full once
    # (or after four times --warmup, where the pool bounds the batch), so a large --max-running measures its
    # steady state rather than its ramp.
    steps = {"graph": [], "eager": []}
    launches = {"graph": [], "eager": []}
    done, out_tokens = 0, 0
    t_start = time.perf_counter()
    warm_until = t_start + args.warmup
    give_up_filling = t_start + 4 * args.warmup
    filled = False
    t0 = None
    while engine.has_unfinished():
        s0 = time.perf_counter()
        flight = engine.launch_step()
        launched = time.perf_counter() - s0
        outs = engine.finish_step(flight)  # waits for this flight's tokens (steps launched ahead included)
        dt = time.perf_counter() - s0
        filled = filled or len(engine.running) >= args.max_running
        if t0 is None and s0 >= warm_until and (filled or s0 >= give_up_filling):
            t0 = s0
            counted_from = copy.deepcopy(engine.step_stats)  # its counters when the window opened
            built_before = builds.snapshot()
        if t0 is not None:
            kind = "graph" if flight.replayed else "eager"
            steps[kind].append(dt)
            launches[kind].append(launched)
            out_tokens += sum(len(o.new_token_ids) for o in outs)
            done += sum(1 for o in outs if o.finished)
            if time.perf_counter() - t0 >= args.seconds:
                break
    if t0 is None:
        print(f"the trace ran out before its warm-up ended ({args.requests} requests): raise --requests",
              file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    window = window_steps(counted_from, engine.step_stats)
    result = {"model": "tiny" if args.smoke else args.model, "adapters": args.adapters, "seconds": wall, "completed": done,
              "req_per_s": done / wall, "out_tok_per_s": out_tokens / wall,
              "graph_steps": len(steps["graph"]), "eager_steps": len(steps["eager"]),
              "graph_step_ms": 1e3 * float(np.mean(steps["graph"])) if steps["graph"] else None,
              "eager_step_ms": 1e3 * float(np.mean(steps["eager"])) if steps["eager"] else None,
              "graph_launch_ms": 1e3 * float(np.mean(launches["graph"])) if launches["graph"] else None,
              "eager_launch_ms": 1e3 * float(np.mean(launches["eager"])) if launches["eager"] else None,
              "eager_time_share": sum(steps["eager"]) / wall, "running_at_end": len(engine.running),
              "warmup_s": t0 - t_start, "filled_in_warmup": filled,
              "preemptions": engine.num_preemptions, "pool_slots": engine.pool.num_slots,
              # Since the start, warm-up included: steps launched ahead of the last one's tokens, admission
              # steps, those of them launched ahead, and places of requests ending by length they took early.
              "lookahead_steps": engine.lookahead_steps, "admission_steps": engine.admission_steps,
              "admissions_ahead": engine.admissions_ahead, "places_taken_ahead": engine.places_taken_ahead,
              "held_back": dict(engine.held_back),  # steps not launched ahead, by why (Engine.held_back)
              # Triton kernel variants built inside the window (compiled or read from the disk cache), and in
              # all: None where Triton has no build hooks; none under the CPU interpreter.
              "kernel_builds_window": builds.summary(built_before), "kernel_builds": builds.summary(),
              "worker_warmup": worker_warmup,  # None: not run (--worker-warmup)
              "config": {k: v for k, v in extra.items() if v != getattr(EngineConfig, k)}}
    setting = get_setting("tiny") if args.smoke else setting_of(args.model)
    dtype_bytes = 4 if args.smoke else 2
    result.update(steps=with_floors(window, setting, ceilings, dtype_bytes), ceilings=ceilings.as_dict())
    if args.host_profile_steps:
        result["host_profiled"] = host_profile_steps(engine, args.host_profile_steps, args.host_profile_out)
    if args.profile_steps:
        result["profiled"] = profile_steps(engine, args.profile_steps, args.profile_out)
    print(json.dumps(result), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    return 0


def run_steps(engine: Engine, n: int):
    """Up to `n` more steps, each as ("graph" or "eager", its seconds from launch until its tokens are in)."""
    for _ in range(n):
        if not engine.has_unfinished():
            return
        started = time.perf_counter()
        flight = engine.launch_step()
        engine.finish_step(flight)
        yield ("graph" if flight.replayed else "eager"), time.perf_counter() - started


def host_profile_steps(engine: Engine, n: int, out: str) -> dict:
    """Run up to `n` steps under cProfile and write the host's functions by their own and cumulative time to
    `out`. A step whose GPU interval is far past its floor while the stream never idles (gpu_ms against
    floor_ms) waits on the host issuing it: this names the host work, and a synchronizing call shows up as a
    torch method's own time. Returns the steps by kind and the host's milliseconds a step."""
    kinds = {"graph": 0, "eager": 0}
    host_s = {"graph": 0.0, "eager": 0.0}
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for kind, seconds in run_steps(engine, n):
        kinds[kind] += 1
        host_s[kind] += seconds
    profiler.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for order in ("tottime", "cumulative"):
        text.write(f"\n==== by {order} ====\n")
        stats.sort_stats(order).print_stats(40)
    steps = sum(kinds.values())
    with open(out, "w") as f:
        f.write(f"{steps} steps ({kinds['graph']} graph, {kinds['eager']} eager), "
                f"{wall * 1e3 / max(steps, 1):.2f} ms a step under cProfile\n{text.getvalue()}")
    return {"steps": kinds, "wall_ms_a_step": wall * 1e3 / max(steps, 1),
            "ms_a_step": {k: round(host_s[k] * 1e3 / kinds[k], 3) if kinds[k] else None for k in kinds},
            "table": out}


def profile_steps(engine: Engine, n: int, out: str) -> dict:
    """Run up to `n` steps under the profiler; write their kernels' table to `out`. Returns the steps by kind
    and their wall and kernel milliseconds a step (the wall is the profiler's; module doc). Kernels of graph
    replays are recorded one by one, as eager steps' are."""
    gpu = engine.device.type == "cuda"
    kinds = {"graph": 0, "eager": 0}
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]) as prof:
        for kind, _ in run_steps(engine, n):
            kinds[kind] += 1
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) if gpu else 0.0
    table = events.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=40,
                         max_name_column_width=70)
    steps = sum(kinds.values())
    wall_ms, kernel_ms = wall * 1e3 / max(steps, 1), kernel_us / 1e3 / max(steps, 1)
    with open(out, "w") as f:
        kernels = f"{kernel_ms:.2f} ms of GPU kernels" if gpu else "on the CPU (no GPU kernels)"
        f.write(f"{steps} steps ({kinds['graph']} graph, {kinds['eager']} eager), {wall_ms:.2f} ms a step of wall "
                f"time under the profiler, {kernels}\n{table}\n")
    return {"steps": kinds, "wall_ms_a_step": wall_ms, "kernel_ms_a_step": kernel_ms, "table": out}


if __name__ == "__main__":
    sys.exit(main())
