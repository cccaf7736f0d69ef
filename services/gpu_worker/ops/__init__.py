"""Op backends. Every backend exposes write_kv, attention, lora_shrink and lora_expand with the
signatures of `reference`; the engine picks one per device."""
from __future__ import annotations

from types import ModuleType

import torch


def select_backend(device: torch.device, name: str = "auto") -> ModuleType:
    """`reference` (torch ops, any device) or `triton` (Triton kernels, CUDA)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "reference":
        from . import reference
        return reference
    if name == "triton":
        from . import triton_backend
        return triton_backend
    raise ValueError(f"unknown op backend {name!r}: expected auto, reference or triton")
