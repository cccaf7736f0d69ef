"""Op backends. Every backend exposes write_kv, attention, lora_shrink and lora_expand with the
signatures of `reference`; the engine picks one per device."""
from __future__ import annotations

from types import ModuleType

import torch


def select_backend(device: torch.device, name: str = "auto", lora_mode: str = "unified") -> ModuleType:
    """`reference` (torch ops, any device) or `triton` (Triton kernels, CUDA); lora_mode "bmm" swaps its
    LoRA ops for the padded-bmm baseline's (ops/bmm_lora.py), any other mode keeps them."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "reference":
        from . import reference as ops
    elif name == "triton":
        from . import triton_backend as ops
    else:
        raise ValueError(f"unknown op backend {name!r}: expected auto, reference or triton")
    if lora_mode == "bmm":
        from .bmm_lora import with_bmm_lora
        return with_bmm_lora(ops)
    return ops
