"""Where an admission round's eager prefill step goes: the step that prefills a round of requests (32 by
default, S-LoRA-like prompt lengths) timed and profiled base-only and with each request on its own adapter.

At S2 saturation these steps took 182 ms with 100 adapters against 98 ms base-only (docs/benchmarks.md,
"Engine at saturation"), a quarter of the time; the torch profiler's kernel table says which kernels make
the difference. Each mode also reports how long the host took to launch the step: a launch as long as the
step means the GPU waited on the host issuing kernels.

    python benchmarks/profile_prefill.py --out prefill.txt            # Llama-2-7B shapes on a GPU
    python benchmarks/profile_prefill.py --model llama3-8b            # S-GQA: Llama-3-8B, all seven linears
    python benchmarks/profile_prefill.py --model tiny --out p.txt      # the script itself, on a CPU
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_decode import LLAMA2_7B, LLAMA3_8B, synthetic_adapter
from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig
from shared.model_config import MODULES, ModelConfig

RANKS = (64, 32, 16, 8)
TARGETS = {"llama2-7b": ("q_proj", "k_proj", "v_proj", "o_proj"), "llama3-8b": MODULES,
           "tiny": ("q_proj", "k_proj", "v_proj", "o_proj")}


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


def finish(engine: Engine) -> None:
    while engine.running or engine.waiting:
        engine.step()


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
    p.add_argument("--out", default="prefill.txt")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    cuda = torch.cuda.is_available()
    engine = Engine.with_dummy_weights(cfg, EngineConfig(
        device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", num_slots=80_000 if cuda else 4096,
        max_lora_rank=max(RANKS), max_resident_adapters=args.requests + 4, max_running_requests=args.requests,
        max_batched_tokens=args.max_batched_tokens))
    names = [f"a{i}" for i in range(args.requests)]
    for i, name in enumerate(names):  # every request of the round on its own adapter, ranks mixed
        engine._local_adapters[name] = synthetic_adapter(name, cfg, RANKS[i % len(RANKS)], TARGETS[args.model],
                                                        engine.device)
    lengths = [random.Random(i).randrange(args.prompt_min, args.prompt_max) for i in range(args.requests)]
    report = [f"round of {args.requests} requests, {sum(lengths)} prompt tokens, max_batched_tokens "
              f"{args.max_batched_tokens}, {cfg.num_layers} layers"]
    for label, used in (("base", []), ("lora", names)):
        prefill_round(engine, f"{label}-warm", used, args.requests, lengths)  # kernels compiled, adapters in
        finish(engine)
        times, launches = [], []
        for r in range(args.repeats):
            prefill_round(engine, f"{label}-{r}", used, args.requests, lengths)
            sync(engine)
            t0 = time.perf_counter()
            if r == args.repeats - 1:
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    engine.step()
                    sync(engine)
            else:
                flight = engine.launch_step()
                launches.append((time.perf_counter() - t0) * 1e3)
                engine.finish_step(flight)
                sync(engine)
            times.append((time.perf_counter() - t0) * 1e3)
            finish(engine)
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)
        launch = f", launched by the host in {min(launches):.1f} ms" if launches else ""
        report.append(f"== {label}: prefill step {min(times):.1f} ms (best of {args.repeats}; last one profiled)"
                      f"{launch}\n{table}")
    text = "\n".join(report)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
