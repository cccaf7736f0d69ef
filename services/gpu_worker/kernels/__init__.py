"""Triton kernels on the unified pool. The launchers have the signatures of ops.reference (plus optional
keyword arguments), so a backend can swap them in one for one."""
from .lora_expand import lora_expand
from .lora_groups import AdapterGroups, group_tokens_by_adapter
from .lora_shrink import lora_shrink
from .paged_attention import attention
from .write_kv import write_kv

__all__ = ["write_kv", "attention", "lora_shrink", "lora_expand", "group_tokens_by_adapter", "AdapterGroups"]
