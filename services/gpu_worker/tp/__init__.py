"""Tensor parallelism: the base model Megatron-style and LoRA adapters S-LoRA-style over N ranks."""
from .engine import TPEngine
from .group import TPRankError
from .layout import TPLayout, TPLayoutError

__all__ = ["TPEngine", "TPLayout", "TPLayoutError", "TPRankError"]
