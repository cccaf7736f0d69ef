"""The floor of a point's steps, kind by kind: the least time their work takes with every operation at the
ceiling that binds it, from the worker's step counters (services/gpu_worker/step_stats.py) and the ceilings
measured in the same run (bench/roofline.py).

A kind's steps, over the point:
- linears: each step reads the linear weights once and does 2 FLOPs a weight a token: the longer of the two,
  with the kind's mean tokens a step (a lower bound over steps of any size: the time is convex in tokens);
- LM head: the same over the rows sampled;
- attention: one-token rows read their context's K and V (`decode_keys` tokens of K/V, at the copy rate);
  prompt chunks attend causally, 4 · q_dim FLOPs a (query, key) pair a layer (`prompt_pairs`, at the matmul
  rate);
- LoRA: the adapters' rows each step read (`adapter_bytes`, at the copy rate).
Norms, rotary, the KV write and sampling are left out (a few per cent of a step's bytes), as are prompt
tokens' LoRA FLOPs (under 1% of the linears'). So a kind's `of_floor` (its floor over its mean step) says how
near its steps run to what their own work allows: the rest is kernels below their ceilings, the GPU waiting
on the host, or work the floor does not count.
"""
from __future__ import annotations

from bench.roofline import Ceilings, bound_seconds, kv_bytes_per_token, linear_params
from bench.settings import Setting, get_setting

# The counts a kind's floor needs (StepStats fields of the same names, summed over the kind's steps).
NEEDS = ("steps", "tokens", "decode_keys", "prompt_pairs", "sampled", "adapter_bytes")


def floor_seconds(setting: Setting, ceilings: Ceilings, counts: dict, dtype_bytes: int = 2) -> dict[str, float]:
    """Seconds of a kind's steps at their floor, by part (module doc), and their `total`."""
    steps = counts["steps"]
    if steps <= 0:
        raise ValueError("a floor of no steps")
    cfg = setting.model_config
    linear, head = linear_params(setting), cfg.hidden_size * cfg.vocab_size
    tokens, sampled = counts["tokens"] / steps, counts["sampled"] / steps
    parts = {
        "linears": steps * bound_seconds(linear * dtype_bytes, 2 * linear * tokens, ceilings),
        "lm_head": steps * bound_seconds(head * dtype_bytes, 2 * head * sampled, ceilings) if sampled else 0.0,
        "decode_attention": bound_seconds(counts["decode_keys"] * kv_bytes_per_token(setting, dtype_bytes), 0,
                                          ceilings),
        "prompt_attention": bound_seconds(0, counts["prompt_pairs"] * 4 * cfg.q_dim * cfg.num_layers, ceilings),
        "lora": bound_seconds(counts["adapter_bytes"], 0, ceilings),
    }
    parts["total"] = sum(parts.values())
    return parts


def with_floors(worker_steps: dict | None, setting: Setting, ceilings: Ceilings, dtype_bytes: int = 2) -> dict | None:
    """`worker_steps` (bench/metrics.py) with each kind that ran and recorded the counters given its
    `floor_ms` (a mean step's floor) and `of_floor` (floor over mean step); others left as they are."""
    if not worker_steps:
        return worker_steps
    out = {}
    for kind, figures in worker_steps.items():
        figures = dict(figures)
        if figures.get("steps") and figures.get("mean_ms") and all(figures.get(k) is not None for k in NEEDS):
            floor_ms = 1e3 * floor_seconds(setting, ceilings, figures, dtype_bytes)["total"] / figures["steps"]
            figures["floor_ms"] = round(floor_ms, 3)
            figures["of_floor"] = round(floor_ms / figures["mean_ms"], 4)
        out[kind] = figures
    return out


def window_steps(before, after) -> dict:
    """An engine's steps between two copies of its StepStats (services/gpu_worker/step_stats.py), kind by kind,
    as `loraplex bench` records a point's (`worker_steps`), so an engine run outside a stack gets floors too."""
    out = {}
    for kind in after.steps:
        steps = after.steps[kind] - before.steps[kind]
        seconds = after.seconds[kind] - before.seconds[kind]
        adapters = after.adapters[kind] - before.adapters[kind]
        out[kind] = {"steps": steps, "seconds": seconds, "mean_ms": 1e3 * seconds / steps if steps else None,
                     "adapters_mean": adapters / steps if steps else None,
                     **{name: getattr(after, name)[kind] - getattr(before, name)[kind] for name in NEEDS[1:]},
                     # Graphs captured at first use inside the window's steps, and the host's seconds in them.
                     "captures": after.captures[kind] - before.captures[kind],
                     "capture_s": after.capture_seconds[kind] - before.capture_seconds[kind],
                     # Triton kernel variants built while the window's steps were issued, and their seconds.
                     "builds": after.builds[kind] - before.builds[kind],
                     "build_s": after.build_seconds[kind] - before.build_seconds[kind],
                     "gpu_ms": _gpu_ms(before, after, kind)}
    return out


def _gpu_ms(before, after, kind: str) -> float | None:
    timed = after.gpu_steps[kind] - before.gpu_steps[kind]
    return 1e3 * (after.gpu_seconds[kind] - before.gpu_seconds[kind]) / timed if timed else None


def setting_of(model: str) -> Setting:
    """The serving setting whose base a benchmark's `--model` names (its shapes are what a floor needs)."""
    return get_setting({"llama2-7b": "S2", "llama3-8b": "S-GQA"}[model])
