"""Collective traffic of S-LoRA tensor parallelism, counted by the engine and compared with the paper.

Starts a real TP group on this machine's CPU (gloo, one process per rank) for a configurable model shape with
random weights, loads one random adapter, runs a prefill step and a decode step of `--batch` requests on it,
and prints what each rank sent per layer, by kind, next to the formula: base 2·(N−1)/N·B·h per row-parallel
all-reduce, LoRA on q,k,v,o about 5·(N−1)/N·B·r. Exit status 1 if a count differs from the formula.

    python scripts/tp_traffic.py --tp 2 --hidden 4096 --heads 32 --intermediate 11008 --rank 16 --batch 32
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.gpu_worker.requests import EngineRequest  # noqa: E402
from services.gpu_worker.sampling import SamplingParams  # noqa: E402
from services.gpu_worker.tp import TPEngine, TPLayout  # noqa: E402
from services.gpu_worker.tp.adapter_shards import shard_offsets  # noqa: E402
from services.gpu_worker.tp.comm import KINDS  # noqa: E402
from services.gpu_worker.tp.traffic import expected_elements, paper_base_elements, paper_lora_elements  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.lora_weights import LoraModuleWeights, LoraWeights  # noqa: E402
from shared.model_config import MODULES, ModelConfig  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks N")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size h")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=0, help="KV heads (default: --heads, i.e. MHA)")
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--layers", type=int, default=1, help="decoder layers (traffic is reported per layer)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="requests B (the decode step has B tokens)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, help="adapter rank r")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="adapted modules, comma-separated")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return p.parse_args(argv)


def random_adapter(cfg: ModelConfig, rank: int, targets: list[str]) -> LoraWeights:
    g = torch.Generator().manual_seed(0)
    modules = {}
    for m in targets:
        fan_in, fan_out = cfg.module_dims(m)
        modules[m] = [LoraModuleWeights(torch.randn(rank, fan_in, generator=g) * 0.01,
                                        torch.randn(fan_out, rank, generator=g) * 0.01, 1.0)
                      for _ in range(cfg.num_layers)]
    return LoraWeights("adapter", cfg.num_layers, modules)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in MODULES]
    if unknown:
        sys.stderr.write(f"unknown target module(s) {unknown}; choose from {', '.join(MODULES)}\n")
        return 2
    heads = args.heads
    cfg = ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers, num_heads=heads,
                      num_kv_heads=args.kv_heads or heads, head_dim=args.hidden // heads,
                      max_position_embeddings=args.prompt_len + 8)
    n, b, r, h, L = args.tp, args.batch, args.rank, args.hidden, args.layers
    layout = TPLayout(cfg, n)
    adapter_slots = shard_offsets(tuple(r if m in targets else 0 for m in MODULES), layout)[2]
    config = EngineConfig(dtype=args.dtype, num_slots=b * (args.prompt_len + 2) + adapter_slots + 8,
                          max_lora_rank=max(r, 1), max_resident_adapters=2, max_running_requests=b,
                          max_batched_tokens=b * args.prompt_len)
    element = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    out = sys.stdout
    out.write(f"TP={n}  h={h}  heads={heads}/{cfg.num_kv_heads} kv  intermediate={args.intermediate}  "
              f"layers={L}  B={b}  r={r}  targets={','.join(targets)}  {args.dtype}\n")
    ok = True
    with TPEngine.with_dummy_weights(cfg, config, tp_size=n, log_level="warning") as engine:
        engine.register_adapter("adapter", random_adapter(cfg, r, targets))
        for i in range(b):
            engine.add_request(EngineRequest(f"r{i}", [3 + (i + j) % (args.vocab - 3) for j in range(args.prompt_len)],
                                             SamplingParams(max_tokens=2, ignore_eos=True), "adapter"))
        for name in ("prefill", "decode"):
            engine.step()
            traffic = engine.last_step_traffic
            tokens = b * args.prompt_len if name == "prefill" else b
            expected = expected_elements(n, tokens, h, L, {m: r for m in targets})
            out.write(f"\n{name} step: B = {tokens} tokens; elements sent per rank per layer (bytes)\n")
            out.write(f"  {'kind':<16}{'counted':>22}{'expected':>22}  calls/layer\n")
            for kind in KINDS:
                t = traffic[kind]
                counted, want = t.sent_elements / L, expected[kind] / L
                ok &= counted == want
                out.write(f"  {kind:<16}{_fmt(counted, element):>22}{_fmt(want, element):>22}  "
                          f"{t.calls / L:g}{'' if counted == want else '   MISMATCH'}\n")
            lora = (traffic["lora_all_gather"].sent_elements + traffic["lora_all_reduce"].sent_elements) / L
            base = traffic["base_all_reduce"].sent_elements / L
            out.write(f"  LoRA total {_fmt(lora, element)}; LoRA / base = {float(lora / base):.3%}\n")
            if set(targets) == {"q_proj", "k_proj", "v_proj", "o_proj"}:
                paper, paper_base = paper_lora_elements(n, tokens, r), paper_base_elements(n, tokens, h)
                exact = r % n == 0
                out.write(f"  paper: LoRA 5·(N−1)/N·B·r = {_fmt(paper, element)}"
                          f" ({'equal' if lora == paper else 'differs: r padded to N·ceil(r/N) in the q/k/v gather' if not exact else 'MISMATCH'});"
                          f" base after o 2·(N−1)/N·B·h = {_fmt(paper_base, element)};"
                          f" ratio {float(paper / paper_base):.3%}\n")
                ok &= lora == paper or not exact
        out.write(f"\ncontrol channel: last step plan {engine.last_plan_bytes} bytes to {n - 1} follower(s)\n")
    out.write("counted traffic matches the formula\n" if ok else "counted traffic DIFFERS from the formula\n")
    return 0 if ok else 1


def _fmt(elements: Fraction, element_size: int) -> str:
    return f"{float(elements):,.0f} ({float(elements * element_size):,.0f} B)"


if __name__ == "__main__":
    sys.exit(main())
