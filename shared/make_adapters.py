"""Random PEFT LoRA adapters for a base model: test fixtures, demo adapters and benchmark populations.

Magnitudes are chosen so that an adapter clearly changes a tiny model's greedy output (the whole point
of a test that checks which adapter served a request) while logits stay in a sane range: for an input
of unit RMS, each adapted module's LoRA term has RMS about `strength`, whatever the rank and scale.
Unlike PEFT's own initialisation, B is never zero.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, module_name, parse_config, tensor_key
from shared.model_config import MODULES, ModelConfig

DEFAULT_RANKS = (8, 16)
DEFAULT_TARGETS = MODULES
DEFAULT_ALPHA = 16
DEFAULT_STRENGTH = 0.5


def adapter_names(count: int, prefix: str = "adapter") -> list[str]:
    width = max(3, len(str(count - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(count)]


def random_adapter_tensors(config: dict, cfg: ModelConfig, generator: torch.Generator,
                           strength: float = DEFAULT_STRENGTH) -> dict[str, torch.Tensor]:
    """lora_A/lora_B for every module the config targets, ranks and scales by PEFT's rules."""
    spec = parse_config(config, cfg)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for module in MODULES:
            full = module_name(layer, module)
            if not spec.targets(full):
                continue
            r, alpha, _ = spec.rank_alpha(full)
            fan_in, fan_out = cfg.module_dims(module)
            # x·Aᵀ has about unit RMS per entry; B then sums r of them, and the scale multiplies the result.
            a = torch.randn(r, fan_in, generator=generator) / math.sqrt(fan_in)
            b_std = strength / (abs(spec.scale(r, alpha)) * math.sqrt(r))
            b = torch.randn(fan_out, r, generator=generator) * b_std
            tensors[tensor_key(layer, module, "A")] = a.contiguous()
            tensors[tensor_key(layer, module, "B")] = b.contiguous()
    return tensors


def make_adapters(
    adapters_dir: str | Path,
    base_dir: str | Path,
    count: int,
    ranks: Sequence[int] = DEFAULT_RANKS,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    *,
    lora_alpha: float = DEFAULT_ALPHA,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    use_rslora: bool = False,
    layers_to_transform: Sequence[int] | None = None,
    strength: float = DEFAULT_STRENGTH,
    prefix: str = "adapter",
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write `count` PEFT adapter folders (`adapter-000`, ...) for the base model in `base_dir`.

    Adapter i has rank `ranks[i % len(ranks)]`; `rank_pattern` / `alpha_pattern` (PEFT keys) override it
    per module. Returns the folders in order.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not ranks or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"ranks must be positive integers, got {list(ranks)}")
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise ValueError(f"unknown target module(s) {unknown or list(targets)}; choose from {', '.join(MODULES)}")
    config_path = Path(base_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"base model folder {str(base_dir)!r} has no config.json")
    cfg = ModelConfig.from_dir(base_dir)

    out = Path(adapters_dir)
    out.mkdir(parents=True, exist_ok=True)
    folders = []
    for i, name in enumerate(adapter_names(count, prefix)):
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(Path(base_dir).resolve()),
            "inference_mode": True,
            "r": ranks[i % len(ranks)],
            "lora_alpha": lora_alpha,
            "lora_dropout": 0.0,
            "use_rslora": use_rslora,
            "target_modules": [m for m in MODULES if m in targets],
            "layers_to_transform": list(layers_to_transform) if layers_to_transform is not None else None,
            "rank_pattern": dict(rank_pattern or {}),
            "alpha_pattern": dict(alpha_pattern or {}),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "init_lora_weights": True,
            "use_dora": False,
        }
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        tensors = random_adapter_tensors(config, cfg, generator, strength)
        folder = out / name
        folder.mkdir(exist_ok=True)
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        folders.append(folder)
        if progress is not None:
            progress(i + 1, count)
    return folders


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 8,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"ranks must be positive integers, got {text!r}")
    return values


def _module_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in MODULES]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown target module(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(MODULES)}")
    return values


class _Progress:
    """One self-overwriting line on a terminal; a line per 10% otherwise (logs stay short)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            width = 30
            filled = width * done // total
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} adapters")
            if done == total:
                self.stream.write("\n")
        else:
            decile = 10 * done // total
            if decile != self.last_decile:
                self.last_decile = decile
                self.stream.write(f"{done}/{total} adapters\n")
        self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    """`loraplex make-adapters`"""
    parser = argparse.ArgumentParser(
        prog="loraplex make-adapters",
        description="Write N random PEFT LoRA adapters (one folder each) for a base model.",
    )
    parser.add_argument("dir", help="output folder; adapters go in DIR/adapter-000, DIR/adapter-001, ...")
    parser.add_argument("--base", required=True, metavar="MODEL_DIR", help="base model folder (its config.json)")
    parser.add_argument("--count", required=True, type=int, help="number of adapters")
    parser.add_argument("--ranks", type=_int_list, default=list(DEFAULT_RANKS),
                        help="ranks, cycled over the adapters (default 8,16)")
    parser.add_argument("--targets", type=_module_list, default=list(DEFAULT_TARGETS),
                        help=f"adapted modules (default {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    if not (Path(args.base) / "config.json").is_file():
        parser.error(f"--base {args.base}: no config.json there (make one with `loraplex make-model DIR`)")
    folders = make_adapters(args.dir, args.base, args.count, ranks=args.ranks, targets=args.targets,
                            seed=args.seed, progress=_Progress(sys.stderr) if args.count > 1 else None)
    sys.stdout.write(f"wrote {len(folders)} adapters to {args.dir}\n")
    return 0
