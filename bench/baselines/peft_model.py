"""The PEFT baseline's model side: a transformers causal LM, PEFT adapters kept in an LRU, greedy batches.

Everything here runs on the one worker thread that owns the GPU. Adapters are PEFT folders
(adapter_config.json + adapter_model.safetensors); only folders with safetensors weights are accepted,
so PEFT's loader never falls back to a pickled adapter_model.bin.
"""
from __future__ import annotations

import contextlib
import inspect
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from shared.adapter_format import CONFIG_FILE, PICKLE_FILE, WEIGHTS_FILE
from shared.log import get_logger

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

log = get_logger("peft_baseline")


def _dtype_kwarg() -> str:
    # transformers renamed `torch_dtype` to `dtype` in 4.56; older releases only know the first.
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_hf_config(path: str | Path):
    """A transformers config from a model folder or from a config.json file."""
    from transformers import AutoConfig

    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} has no config.json")
        return AutoConfig.from_pretrained(str(p))
    if not p.is_file():
        raise ValueError(f"{p} is neither a model folder nor a config JSON file")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{p} is not a transformers config (no model_type)")
    return AutoConfig.for_model(**raw)


def build_base_model(model_dir: str | Path | None, dummy_config: str | Path | None, device: str,
                     dtype: torch.dtype, seed: int = 0):
    """The base causal LM in eval mode on `device` in `dtype`.

    With a dummy config, weights are random (seeded) and created directly on the device in the dtype:
    nothing is read or written besides the config, so 7B/13B shapes start in seconds.
    """
    from transformers import AutoModelForCausalLM

    kw = {_dtype_kwarg(): dtype}
    if dummy_config is not None:
        config = load_hf_config(dummy_config)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kw)
    else:
        # use_safetensors: a checkpoint with only pickled weights is refused rather than unpickled.
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), use_safetensors=True, **kw)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model


def index_adapters(adapters_dir: str | Path) -> dict[str, Path]:
    """Adapter name (folder name) -> folder, sorted by name; every subfolder must be a PEFT adapter."""
    root = Path(adapters_dir)
    if not root.is_dir():
        raise ValueError(f"--adapters-dir {root} is not a folder")
    out: dict[str, Path] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if not (folder / CONFIG_FILE).is_file():
            raise ValueError(f"adapter folder {folder} has no {CONFIG_FILE}")
        if not (folder / WEIGHTS_FILE).is_file():
            hint = f" (only {PICKLE_FILE}: pickled weights are never loaded)" if (folder / PICKLE_FILE).exists() else ""
            raise ValueError(f"adapter folder {folder} has no {WEIGHTS_FILE}{hint}")
        out[folder.name] = folder
    return out


class AdapterCache:
    """At most `max_loaded` adapters injected into the model through PEFT, least recently used evicted.

    The PeftModel is created by the first load. A new adapter is loaded before the evicted one is deleted,
    so PEFT never sees a model with no adapter at all (it has no such state); residency peaks at
    max_loaded + 1 for the length of one load.
    """

    def __init__(self, base, adapters: dict[str, Path], max_loaded: int, device: str):
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.base = base
        self.peft = None
        self.adapters = adapters
        self.max_loaded = max_loaded
        self.device = device
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> bytes on the device, LRU first
        self.loads = 0
        self.load_bytes = 0
        self.evictions = 0

    @property
    def model(self):
        return self.peft if self.peft is not None else self.base

    def _load(self, name: str) -> None:
        from peft import PeftModel

        folder = str(self.adapters[name])
        # Adapter weights in the base model's dtype (PEFT would upcast them to fp32 by default), loaded
        # straight into place without a random init first.
        kw = {"autocast_adapter_dtype": False, "low_cpu_mem_usage": True}
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, folder, adapter_name=name, **kw)
            self.peft.eval()
        else:
            self.peft.load_adapter(folder, adapter_name=name, torch_device=self.device, **kw)
        marker = f".{name}."
        size = sum(p.numel() * p.element_size() for n, p in self.peft.named_parameters() if marker in n)
        self.resident[name] = size
        self.loads += 1
        self.load_bytes += size
        log.debug("adapter loaded", adapter=name, bytes=size, resident=len(self.resident))

    def ensure(self, name: str) -> bool:
        """Make `name` resident and most recently used; True if it had to be loaded."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return False
        self._load(name)
        while len(self.resident) > self.max_loaded:
            victim, _ = self.resident.popitem(last=False)
            self.peft.delete_adapter(victim)
            self.evictions += 1
            log.debug("adapter evicted", adapter=victim)
        return True

    def activate(self, name: str | None) -> contextlib.AbstractContextManager:
        """Context in which `self.model` computes with adapter `name` (None: the base model alone)."""
        if name is None:
            return self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
        self.ensure(name)
        self.peft.set_adapter(name)
        return contextlib.nullcontext()

    def stats(self) -> dict:
        return {"resident": list(self.resident), "max_loaded": self.max_loaded, "adapter_loads": self.loads,
                "adapter_load_bytes": self.load_bytes, "adapter_evictions": self.evictions}


def _prefill_kwargs(params) -> dict:
    # Prefill needs logits of the last position only; without this, a 16 x 512 prompt batch materialises
    # 16 x 512 x vocab logits. The argument is `logits_to_keep` since transformers 4.50.
    if "logits_to_keep" in params:
        return {"logits_to_keep": 1}
    if "num_logits_to_keep" in params:
        return {"num_logits_to_keep": 1}
    return {}


class GreedyRunner:
    """Runs one left-padded batch with greedy decoding and a KV cache, one callback per decode step."""

    def __init__(self, base, device: str, pad_token_id: int):
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        params = inspect.signature(base.forward).parameters
        self.prefill_kwargs = _prefill_kwargs(params)
        # The KV cache argument and output field are `past_key_values` until transformers 5.x renamed them
        # `cache` (the old name is deprecated there).
        self.cache_name = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def run(self, model, prompts: list[list[int]], steps: int, on_step: Callable[[int, list[int]], bool]) -> int:
        """Generate up to `steps` tokens per row; `on_step(i, tokens)` gets step i's token of every row and
        returns False to stop early (nobody is listening any more). Returns the steps run."""
        b, width = len(prompts), max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits in the last column, so one decode step serves
        # all rows; positions count real tokens only, so padding does not shift the rotary phases.
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **self.prefill_kwargs)
        token = out.logits[:, -1].argmax(-1)
        ones = mask.new_ones(b, 1)
        for step in range(steps):
            if not on_step(step, token.tolist()) or step == steps - 1:
                return step + 1
            mask = torch.cat([mask, ones], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self.cache_name: getattr(out, self.cache_name)})
            token = out.logits[:, -1].argmax(-1)
        return steps
