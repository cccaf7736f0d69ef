"""Where an admission round's eager prefill step goes: the step that prefills a round of requests (32 by
default, S-LoRA-like prompt lengths) timed and profiled base-only and with each request on its own adapter.

At S2 saturation these steps took 182 ms with 100 adapters against 98 ms base-only (docs/benchmarks.md,
"Engine at saturation"), a quarter of the time; the torch profiler's kernel table says which kernels make
the difference. Each mode also reports how long the host took to launch the step: a launch as long as the
step means the GPU waited on the host issuing kernels. With `--running N` the round is admitted beside N
requests already decoding (each on an adapter of its own, cycling over --adapters), as a serving worker's
admission step is at saturation (224 running beside a round of 32): that step also runs the running batch's
decode tokens, and their LoRA segments, eagerly.

    python benchmarks/profile_prefill.py --out prefill.txt            # Llama-2-7B shapes on a GPU
    python benchmarks/profile_prefill.py --model llama3-8b            # S-GQA: Llama-3-8B, all seven linears
    python benchmarks/profile_prefill.py --running 224 --adapters 100  # the admission step at saturation
    python benchmarks/profile_prefill.py --model tiny --out p.txt      # the script itself, on a CPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
import types
import warnings
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_decode import LLAMA2_7B, LLAMA3_8B, TARGETS, synthetic_adapter
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.model_config import ModelConfig

RANKS = (64, 32, 16, 8)


def model_config(name: str) -> ModelConfig:
    if name == "tiny":
        from shared.tiny_model import VOCAB_SIZE, hf_config

        return ModelConfig.from_hf(hf_config("tiny", VOCAB_SIZE))
    return ModelConfig.from_hf(LLAMA2_7B if name == "llama2-7b" else LLAMA3_8B)


def prefill_round(engine: Engine, label: str, adapters: list[str], requests: int, lengths: list[int]) -> None:
    """Queue one round; the engine's next step prefills it (within max_batched_tokens)."""
    rng = random.Random(len(lengths))
    for i in range(requests):
        prompt = [rng.randrange(3, engine.cfg.vocab_size) for _ in range(lengths[i % len(lengths)])]
        engine.add_request(EngineRequest(f"{label}-{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                                         adapters[i % len(adapters)] if adapters else None))


def start_running(engine: Engine, label: str, adapters: list[str], count: int) -> list[str]:
    """`count` requests prefilled and decoding, each allowed up to the context length (aborted after)."""
    rng = random.Random(count)
    ids = [f"{label}-running-{i}" for i in range(count)]
    for i, rid in enumerate(ids):
        prompt = [rng.randrange(3, engine.cfg.vocab_size) for _ in range(rng.randrange(8, 512))]
        limit = engine.max_model_len - len(prompt)
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=limit, ignore_eos=True),
                                         adapters[i % len(adapters)] if adapters else None))
    while engine.waiting or any(s.num_computed < len(s.tokens) - 1 for s in engine.running):
        engine.step()
    return ids


def stop_running(engine: Engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    engine.step()


def finish(engine: Engine, running: int = 0) -> None:
    """Step until only the `running` long requests are left."""
    while len(engine.running) > running or engine.waiting:
        engine.step()


class OpTimer:
    """Host time of each backend op call during one launch: a uniform cost a call says the launch path is
    slow; one call far longer than its peers says the host waited there (a hidden sync)."""

    def __init__(self, engine: Engine):
        self.engine, self.calls = engine, defaultdict(list)
        ops = engine.model.ops
        wrapped = {name: self._timed(name, fn) if callable(fn) and not isinstance(fn, type) else fn
                   for name, fn in vars(ops).items() if not name.startswith("__")}
        self.proxy = types.SimpleNamespace(**wrapped)

    def _timed(self, name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[name].append((time.perf_counter() - t0) * 1e6)
        return call

    def launch(self):
        """One launch with the ops timed and CUDA syncs reported; (flight, launch ms, sync warnings)."""
        model, original = self.engine.model, self.engine.model.ops
        model.ops = self.proxy
        # The base projections are torch's, not a backend op: timed too (cuBLAS's host cost per call).
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = self._timed("linear", linear)
        cuda = self.engine.device.type == "cuda"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                flight = self.engine.launch_step()
                ms = (time.perf_counter() - t0) * 1e3
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            model.ops = original
            torch.nn.functional.linear = linear
        # Only the mode's reports: setting the mode also warns once that it is a prototype.
        syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
        return flight, ms, syncs

    def table(self, launch_ms: float, syncs: list[str]) -> str:
        rows = [f"launch {launch_ms:.1f} ms with each op timed; {len(syncs)} synchronizing call(s)"
                + "".join(f"\n  sync: {s}" for s in syncs[:5])]
        rows.append(f"  {'op':<14} {'calls':>6} {'total ms':>9} {'median us':>10} {'max us':>9}")
        total = 0.0
        for name, us in sorted(self.calls.items(), key=lambda kv: -sum(kv[1])):
            total += sum(us)
            rows.append(f"  {name:<14} {len(us):>6} {sum(us) / 1e3:>9.2f} {sorted(us)[len(us) // 2]:>10.1f} "
                        f"{max(us):>9.1f}")
        rows.append(f"  ops {total / 1e3:.1f} ms of the launch (the base GEMMs as `linear`); the rest is "
                    f"scheduling, the batch's inputs and the model's own Python")
        return "\n".join(rows)


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=("llama2-7b", "llama3-8b", "tiny"), default="llama2-7b")
    p.add_argument("--requests", type=int, default=32, help="requests in the round (the admission round)")
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=512, help="prompt lengths uniform in [min, max)")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per mode (after one untimed)")
    p.add_argument("--running", type=int, default=0, help="requests decoding beside the round (0: the round alone)")
    p.add_argument("--adapters", type=int, default=0,
                   help="distinct adapters (0: one per request of the round); the running requests cycle over them")
    p.add_argument("--host-profile", action="store_true",
                   help="also run two more rounds per mode: one with the host's launch of its step under cProfile "
                        "(which Python functions the launch time goes to), one with each backend op's host time "
                        "and any CUDA sync reported")
    p.add_argument("--direct-launch", action="store_true",
                   help="layers after the first launch their Triton kernels direct (worker.direct_launch)")
    p.add_argument("--out", default="prefill.txt")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    cuda = torch.cuda.is_available()
    engine = Engine.with_dummy_weights(cfg, EngineConfig(
        device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", num_slots=0 if cuda else 8192,
        max_lora_rank=max(RANKS), max_running_requests=args.requests + args.running,
        max_batched_tokens=args.max_batched_tokens, direct_launch=args.direct_launch,
        overlap_steps=False))  # one admission step at a time, its whole launch on the host's clock
    names = [f"a{i}" for i in range(args.adapters or args.requests)]
    for i, name in enumerate(names):  # ranks mixed; by default each request of the round on its own adapter
        engine._local_adapters[name] = synthetic_adapter(name, cfg, RANKS[i % len(RANKS)],
                                                        TARGETS.get(args.model, TARGETS["llama2-7b"]),  # tiny: as S2
                                                        engine.device)
    lengths = [random.Random(i).randrange(args.prompt_min, args.prompt_max) for i in range(args.requests)]
    report = [f"round of {args.requests} requests, {sum(lengths)} prompt tokens, beside {args.running} running, "
              f"max_batched_tokens {args.max_batched_tokens}, {cfg.num_layers} layers"
              + (", Triton kernels launched direct after the first layer" if args.direct_launch else "")]
    for label, used in (("base", []), ("lora", names)):
        running = start_running(engine, label, used, args.running)
        prefill_round(engine, f"{label}-warm", used, args.requests, lengths)  # kernels compiled, adapters in
        finish(engine, args.running)
        times, launches = [], []
        for r in range(args.repeats):
            prefill_round(engine, f"{label}-{r}", used, args.requests, lengths)
            sync(engine)
            t0 = time.perf_counter()
            if r == args.repeats - 1:
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    engine.step()
                    sync(engine)
                # Timed with the profiler's overhead: it counts only where no other repeat was timed.
                profiled_ms = (time.perf_counter() - t0) * 1e3
            else:
                flight = engine.launch_step()
                launches.append((time.perf_counter() - t0) * 1e3)
                engine.finish_step(flight)
                sync(engine)
                times.append((time.perf_counter() - t0) * 1e3)
            finish(engine, args.running)
        times = times or [profiled_ms]
        host = ""
        if args.host_profile:
            prefill_round(engine, f"{label}-host", used, args.requests, lengths)
            sync(engine)
            profiler = cProfile.Profile()
            profiler.enable()
            flight = engine.launch_step()
            profiler.disable()
            engine.finish_step(flight)
            sync(engine)
            finish(engine, args.running)
            stream = io.StringIO()
            stats = pstats.Stats(profiler, stream=stream)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
            host = f"\n-- host launch under cProfile (by own time, then by cumulative time)\n{stream.getvalue()}"
            prefill_round(engine, f"{label}-ops", used, args.requests, lengths)
            sync(engine)
            timer = OpTimer(engine)
            flight, ms, syncs = timer.launch()
            engine.finish_step(flight)
            sync(engine)
            finish(engine, args.running)
            host += f"\n-- host time per op call in one more launch\n{timer.table(ms, syncs)}\n"
        stop_running(engine, running)
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)
        launch = f", launched by the host in {min(launches):.1f} ms" if launches else ""
        report.append(f"== {label}: prefill step {min(times):.1f} ms (best of {len(times)}, then one profiled)"
                      f"{launch}\n{table}{host}")
    text = "\n".join(report)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
