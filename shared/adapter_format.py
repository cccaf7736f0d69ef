"""PEFT LoRA adapters on disk and on the wire: strict validation against a base model, and writing.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors`, as
`peft.PeftModel.save_pretrained` writes it. Loading checks everything the engine relies on (shapes against
the base, ranks, finiteness, which modules are targeted) so that a bad upload is refused with a message
naming the problem before it ever reaches a GPU. Pickled weights (`adapter_model.bin`) are never opened.

Which modules an adapter targets and the rank/alpha of each follow PEFT's own rules, applied to the module's
full name in the base model (`model.layers.3.self_attn.q_proj`):
- target_modules: a list matches a name equal to an entry or ending in `.entry`; a string is a regex that
  must match the whole name; `all-linear` means every adaptable module.
- rank_pattern / alpha_pattern: the first key k (in file order) for which `(.*\\.)?(k)$` matches the name.
- scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import MODULES, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# The submodule that holds each adaptable linear in a Llama-family decoder layer.
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# Config switches of PEFT LoRA variants whose forward pass is not `x·W + s·(x·Aᵀ)·Bᵀ`; serving them as
# plain LoRA would silently produce wrong outputs.
UNSUPPORTED_VARIANTS = {
    "use_dora": "DoRA (use_dora) adapters are not supported; merge or retrain as plain LoRA",
    "lora_bias": "adapters with a LoRA bias (lora_bias) are not supported",
    "use_qalora": "QA-LoRA (use_qalora) adapters are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}

# PEFT's default targets for the Llama family when target_modules is null.
DEFAULT_TARGETS = ("q_proj", "v_proj")

_PAIR_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>[A-Za-z_]\w*)\.(?P<module>[A-Za-z_]\w*)"
    r"\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)
_ANY_LORA_KEY = re.compile(r"^(?:.*\.)?(?P<module>[^.]+)\.lora_(?:[AB]|embedding_[AB])(?:\.default)?(?:\.weight)?$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem and the field or tensor."""


def module_name(layer: int, module: str) -> str:
    """Full name of an adaptable module in the base model, the name PEFT matches its patterns against."""
    return f"model.layers.{layer}.{BLOCK[module]}.{module}"


def tensor_key(layer: int, module: str, ab: str) -> str:
    """Key under which PEFT saves one LoRA matrix (`ab` is "A" or "B")."""
    return f"base_model.model.{module_name(layer, module)}.lora_{ab}.weight"


def _other_module_names(num_layers: int) -> list[str]:
    """Names of the base model's modules that LoRA cannot adapt here, to catch targets such as lm_head."""
    names = ["lm_head", "model", "model.embed_tokens", "model.norm", "model.rotary_emb", "model.layers"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.input_layernorm",
                  f"{p}.post_attention_layernorm"]
    return names


@dataclass(frozen=True)
class AdapterSpec:
    """The parts of adapter_config.json that decide which modules are adapted, and with what rank/scale."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # a tuple of names, or one regex
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def targets(self, name: str) -> bool:
        """PEFT's rule for whether the module with this full name gets a LoRA layer."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, name):
                    return False
            elif name in ex or any(name.endswith("." + e) for e in ex):
                return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            return True
        if not any(name.endswith("." + t) for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        if self.layers_pattern:
            m = None
            for pattern in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
                if m:
                    break
        else:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        return m is not None and int(m.group("idx")) in self.layers_to_transform

    def rank_alpha(self, name: str) -> tuple[int, float, str]:
        """(rank, alpha, where the rank came from) for one module."""
        r_key = _pattern_key(self.rank_pattern, name)
        a_key = _pattern_key(self.alpha_pattern, name)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        source = f"rank_pattern[{r_key!r}]" if r_key is not None else "r"
        return r, alpha, source

    def scale(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(pattern: dict, name: str) -> str | None:
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


# ---------------------------------------------------------------- config parsing

def parse_config(config_json: bytes | str | dict, cfg: ModelConfig) -> AdapterSpec:
    """Validate adapter_config.json against the base model and return what loading needs."""
    if isinstance(config_json, dict):
        raw = config_json
    else:
        try:
            text = config_json.decode("utf-8") if isinstance(config_json, (bytes, bytearray)) else config_json
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")

    peft_type = raw.get("peft_type")
    if peft_type is None:
        raise AdapterError(f"{CONFIG_FILE} has no peft_type; only LoRA adapters (peft_type \"LORA\") are supported")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only LoRA adapters (peft_type \"LORA\") are")
    for key, message in UNSUPPORTED_VARIANTS.items():
        if raw.get(key):
            raise AdapterError(f"{message} ({key}={raw[key]!r})")
    if raw.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save {raw['modules_to_save']!r} is not supported: an adapter may only add LoRA "
            "matrices, not replace whole modules of the shared base")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"bias {bias!r} is not supported; only bias \"none\" (no trained biases) is")

    r = _positive_int(raw.get("r", 8), "r")
    lora_alpha = _number(raw.get("lora_alpha", 8), "lora_alpha")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"use_rslora must be true or false, got {use_rslora!r}")

    target_modules = _parse_targets(raw.get("target_modules"), cfg)
    exclude = raw.get("exclude_modules")
    if exclude is not None:
        exclude = _regex(exclude, "exclude_modules") if isinstance(exclude, str) else tuple(_str_list(exclude, "exclude_modules"))

    layers = raw.get("layers_to_transform")
    if layers is not None:
        if isinstance(target_modules, str):
            raise AdapterError("layers_to_transform cannot be used when target_modules is a regex string")
        items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise AdapterError(f"layers_to_transform must be an integer or a list of integers, got {layers!r}")
        for i in items:
            if not 0 <= i < cfg.num_layers:
                raise AdapterError(f"layers_to_transform has layer index {i} out of range: the base model has "
                                   f"{cfg.num_layers} layers (0..{cfg.num_layers - 1})")
        layers = tuple(items)
    lp = raw.get("layers_pattern")
    layers_pattern = () if not lp else ((lp,) if isinstance(lp, str) else tuple(_str_list(lp, "layers_pattern")))

    rank_pattern = _pattern_dict(raw.get("rank_pattern"), "rank_pattern", _positive_int)
    alpha_pattern = _pattern_dict(raw.get("alpha_pattern"), "alpha_pattern", _number)
    return AdapterSpec(r, lora_alpha, use_rslora, target_modules, exclude, layers, layers_pattern,
                       rank_pattern, alpha_pattern)


def _positive_int(value, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AdapterError(f"{field} must be a positive integer, got {value!r}")
    return value


def _number(value, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterError(f"{field} must be a finite number, got {value!r}")
    return value


def _str_list(value, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"{field} must be a string or a list of strings, got {value!r}")
    return value


def _regex(value: str, field: str) -> str:
    try:
        re.compile(value)
    except re.error as e:
        raise AdapterError(f"{field} {value!r} is not a valid regular expression: {e}") from None
    return value


def _pattern_dict(value, field: str, check) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterError(f"{field} must be an object mapping module name patterns to values, got {value!r}")
    out = {}
    for key, v in value.items():
        _regex(key, f"{field} key")
        out[key] = check(v, f"{field}[{key!r}]")
    return out


def _parse_targets(value, cfg: ModelConfig) -> tuple[str, ...] | str:
    supported = ", ".join(MODULES)
    if value is None:
        return DEFAULT_TARGETS
    if isinstance(value, str) and value.lower() == "all-linear":  # PEFT's shorthand; lm_head is excluded
        return MODULES
    if isinstance(value, str):
        _regex(value, "target_modules")
        for other in _other_module_names(cfg.num_layers):
            if re.fullmatch(value, other):
                raise AdapterError(f"target_modules {value!r} matches unknown target module {other!r}; "
                                   f"only {supported} can be adapted")
        if not any(re.fullmatch(value, module_name(i, m)) for i in range(cfg.num_layers) for m in MODULES):
            raise AdapterError(f"target_modules {value!r} matches no adaptable module of the base model")
        return value
    names = _str_list(value, "target_modules")
    if not names:
        raise AdapterError("target_modules is empty")
    for t in names:
        if t.rsplit(".", 1)[-1] not in MODULES:
            raise AdapterError(f"unknown target module {t!r} in target_modules; only {supported} can be adapted")
    return tuple(names)


# ---------------------------------------------------------------- weights

def _parse_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(bytes(data))
    except Exception as e:  # the library raises its own SafetensorError, or others on corrupt input
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None


def _group_pairs(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """{(layer, module): {"A": (key, tensor), "B": (key, tensor)}} with every key accounted for."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key in sorted(tensors):
        m = _PAIR_KEY.match(key)
        if m is None:
            other = _ANY_LORA_KEY.match(key)
            if other is not None and other.group("module") not in MODULES:
                raise AdapterError(f"tensor {key!r} adapts unknown target module {other.group('module')!r}; "
                                   f"only {', '.join(MODULES)} can be adapted")
            if "lora_magnitude_vector" in key:
                raise AdapterError(f"tensor {key!r} is a DoRA magnitude vector; DoRA adapters are not supported")
            raise AdapterError(f"unexpected tensor key {key!r} in {WEIGHTS_FILE}; expected keys like "
                               f"{tensor_key(0, 'q_proj', 'A')!r}")
        layer, module, ab = int(m.group("layer")), m.group("module"), m.group("ab")
        if module not in MODULES:
            raise AdapterError(f"tensor {key!r} adapts unknown target module {module!r}; "
                               f"only {', '.join(MODULES)} can be adapted")
        if m.group("block") != BLOCK[module]:
            raise AdapterError(f"unexpected tensor key {key!r}: {module} lives in {BLOCK[module]}, "
                               f"not {m.group('block')}")
        if layer >= cfg.num_layers:
            raise AdapterError(f"tensor {key!r} has layer index {layer} out of range: the base model has "
                               f"{cfg.num_layers} layers (0..{cfg.num_layers - 1})")
        slot = pairs.setdefault((layer, module), {})
        if ab in slot:
            raise AdapterError(f"tensors {slot[ab][0]!r} and {key!r} are the same lora_{ab} matrix")
        slot[ab] = (key, tensors[key])
    return pairs


def _check_tensor(key: str, t: torch.Tensor, check_values: bool = True) -> None:
    if not t.is_floating_point():
        raise AdapterError(f"tensor {key!r} has dtype {t.dtype}; LoRA weights must be floating point")
    if t.dim() != 2:
        raise AdapterError(f"tensor {key!r} has shape {list(t.shape)}; LoRA matrices are 2-D")
    if not check_values:
        return
    # A float64 sum of finite fp32/fp16/bf16 values cannot overflow, and any NaN or Inf makes it non-finite:
    # the same answer as isfinite(t).all(), without a boolean tensor the size of the weights (4x faster).
    # float64 weights could overflow their own sum, so they take the elementwise check.
    finite = (bool(torch.isfinite(t).all()) if t.dtype == torch.float64
              else math.isfinite(t.sum(dtype=torch.float64).item()))
    if not finite:
        raise AdapterError(f"tensor {key!r} has non-finite values (NaN or Inf)")


def load_adapter_bytes(config_json: bytes, model_safetensors: bytes, cfg: ModelConfig, max_rank: int = 256,
                       name: str = "") -> LoraWeights:
    """Validate and load an adapter from the contents of its two files (the upload path)."""
    return adapter_from_tensors(config_json, _parse_safetensors(model_safetensors), cfg, max_rank, name)


def adapter_from_tensors(config_json: bytes, tensors: dict[str, torch.Tensor], cfg: ModelConfig, max_rank: int = 256,
                         name: str = "", check_values: bool = True) -> LoraWeights:
    """Validate an adapter's config against its tensors and the base model. `check_values=False` skips the
    pass over every weight for NaN/Inf: for content that passed it when it was stored."""
    spec = parse_config(config_json, cfg)
    if not tensors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
    pairs = _group_pairs(tensors, cfg)

    targeted = [(i, m) for i in range(cfg.num_layers) for m in MODULES if spec.targets(module_name(i, m))]
    if not targeted:
        raise AdapterError(f"target_modules {spec.target_modules!r} (layers_to_transform "
                           f"{spec.layers_to_transform!r}) matches no adaptable module of the base model")
    targeted_set = set(targeted)
    for (layer, module), slot in pairs.items():
        if (layer, module) not in targeted_set:
            key = next(iter(slot.values()))[0]
            raise AdapterError(f"unexpected tensor {key!r}: {module_name(layer, module)} is not targeted by "
                               f"{CONFIG_FILE} (target_modules {spec.target_modules!r}, layers_to_transform "
                               f"{spec.layers_to_transform!r})")

    modules: dict[str, list[LoraModuleWeights | None]] = {}
    for layer, module in targeted:
        full = module_name(layer, module)
        slot = pairs.get((layer, module))
        if slot is None:
            raise AdapterError(f"{WEIGHTS_FILE} has no lora_A/lora_B for {full}, which {CONFIG_FILE} targets")
        for ab in ("A", "B"):
            if ab not in slot:
                other = "B" if ab == "A" else "A"
                raise AdapterError(f"missing lora_{ab} for {full}: {slot[other][0]!r} has no "
                                   f"partner {tensor_key(layer, module, ab)!r}")
        (a_key, a), (b_key, b) = slot["A"], slot["B"]
        r, alpha, source = spec.rank_alpha(full)
        if r > max_rank:
            raise AdapterError(f"rank {r} of {full} ({source}) is over the server's max rank {max_rank}")
        _check_tensor(a_key, a, check_values)
        _check_tensor(b_key, b, check_values)
        fan_in, fan_out = cfg.module_dims(module)
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"rank mismatch in {full}: {a_key!r} has rank {a.shape[0]} (shape {list(a.shape)}) "
                               f"but {b_key!r} has rank {b.shape[1]} (shape {list(b.shape)})")
        if a.shape[1] != fan_in:
            raise AdapterError(f"shape mismatch: {a_key!r} is {list(a.shape)}, expected [{a.shape[0]}, {fan_in}] "
                               f"({module} of the base model has in_features={fan_in})")
        if b.shape[0] != fan_out:
            raise AdapterError(f"shape mismatch: {b_key!r} is {list(b.shape)}, expected [{fan_out}, {b.shape[1]}] "
                               f"({module} of the base model has out_features={fan_out})")
        if a.shape[0] != r:
            raise AdapterError(f"rank mismatch in {full}: tensors have rank {a.shape[0]} but {CONFIG_FILE} "
                               f"says {r} ({source})")
        layers = modules.setdefault(module, [None] * cfg.num_layers)
        layers[layer] = LoraModuleWeights(a.contiguous(), b.contiguous(), spec.scale(r, alpha))
    return LoraWeights(name=name, num_layers=cfg.num_layers, modules=modules)


def load_adapter(adapter_dir: str | Path, cfg: ModelConfig, max_rank: int = 256, name: str | None = None) -> LoraWeights:
    """Validate and load a PEFT adapter folder; `name` defaults to the folder's name."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise AdapterError(f"adapter folder {str(d)!r} does not exist or is not a folder")
    config_path, weights_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not weights_path.is_file() and (d / PICKLE_FILE).exists():
        # Never opened: unpickling runs arbitrary code.
        raise AdapterError(f"{PICKLE_FILE} in {str(d)!r} is a pickle and is refused; convert the adapter to "
                           f"{WEIGHTS_FILE} (save_pretrained(..., safe_serialization=True))")
    for p in (config_path, weights_path):
        if not p.is_file():
            raise AdapterError(f"missing file {p.name} in adapter folder {str(d)!r}")
    return load_adapter_bytes(config_path.read_bytes(), weights_path.read_bytes(), cfg, max_rank=max_rank,
                              name=d.name if name is None else name)


# ---------------------------------------------------------------- writing

def _exact_number(x: float) -> int | float:
    """alpha recovered from scale × rank: report 16 rather than 15.999999999999998."""
    rounded = round(x)
    return int(rounded) if abs(x - rounded) <= 1e-9 * max(1.0, abs(x)) else x


def _patterns(values: dict[tuple[int, str], int | float], default, num_layers: int) -> dict[str, int | float]:
    """Per-module keys where a module is uniform over its layers, per-layer full names where it is not."""
    out: dict[str, int | float] = {}
    for module in MODULES:
        per_layer = {layer: v for (layer, m), v in values.items() if m == module}
        distinct = set(per_layer.values())
        if not distinct or distinct == {default}:
            continue
        if len(distinct) == 1:
            out[module] = distinct.pop()
        else:
            for layer, v in sorted(per_layer.items()):
                if v != default:
                    out[module_name(layer, module)] = v
    return out


def adapter_config(weights: LoraWeights, base_model_name_or_path: str, lora_alpha: float | None = None,
                   use_rslora: bool = False) -> dict:
    """A PEFT adapter_config.json that reproduces every module's rank and scale on load."""
    ranks: dict[tuple[int, str], int] = {}
    alphas: dict[tuple[int, str], int | float] = {}
    layer_sets: dict[str, tuple[int, ...]] = {}
    for module in MODULES:
        per_layer = weights.modules.get(module) or []
        present = tuple(i for i, w in enumerate(per_layer) if w is not None)
        if not present:
            continue
        layer_sets[module] = present
        for i in present:
            w = per_layer[i]
            ranks[(i, module)] = w.rank
            alphas[(i, module)] = _exact_number(w.scale * (math.sqrt(w.rank) if use_rslora else w.rank))
    if not ranks:
        raise AdapterError(f"adapter {weights.name!r} adapts no module")
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = lora_alpha if lora_alpha is not None else Counter(alphas.values()).most_common(1)[0][0]

    all_layers = tuple(range(weights.num_layers))
    shared_layers = set(layer_sets.values())
    layers_to_transform = None
    if len(shared_layers) == 1:
        target_modules: list[str] | str = list(layer_sets)
        only = shared_layers.pop()
        if only != all_layers:
            layers_to_transform = list(only)
    else:
        # Modules adapted in different layer sets: name every adapted module exactly.
        target_modules = "|".join(re.escape(module_name(i, m)) for m, present in layer_sets.items() for i in present)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "use_rslora": use_rslora,
        "target_modules": target_modules,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
        "rank_pattern": _patterns(ranks, r, weights.num_layers),
        "alpha_pattern": _patterns(alphas, alpha, weights.num_layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "use_dora": False,
    }


def save_adapter(weights: LoraWeights, adapter_dir: str | Path, base_model_name_or_path: str,
                 lora_alpha: float | None = None, use_rslora: bool = False) -> Path:
    """Write a PEFT folder (adapter_config.json + adapter_model.safetensors) that `PeftModel.from_pretrained`
    loads as is. `lora_alpha` picks the default alpha; modules whose scale needs another get alpha_pattern."""
    from safetensors.torch import save_file

    config = adapter_config(weights, base_model_name_or_path, lora_alpha=lora_alpha, use_rslora=use_rslora)
    tensors: dict[str, torch.Tensor] = {}
    for module, per_layer in weights.modules.items():
        if module not in MODULES:
            raise AdapterError(f"unknown target module {module!r}; only {', '.join(MODULES)} can be adapted")
        for i, w in enumerate(per_layer):
            if w is not None:
                tensors[tensor_key(i, module, "A")] = w.lora_a.detach().cpu().contiguous()
                tensors[tensor_key(i, module, "B")] = w.lora_b.detach().cpu().contiguous()
    out = Path(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
