"""In-memory form of one LoRA adapter, independent of file format and of the pool layout."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraModuleWeights:
    """One adapted linear module in one layer, PEFT convention: delta(x) = scale * (x @ A.T) @ B.T."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class LoraWeights:
    """An adapter: for each adapted module name, one entry per layer (None where that layer is not adapted)."""

    name: str
    num_layers: int
    modules: dict[str, list[LoraModuleWeights | None]]

    def module_rank(self, module: str) -> int:
        """Largest rank of a module over layers (rank_pattern may differ by layer); 0 if not adapted."""
        layers = self.modules.get(module)
        if not layers:
            return 0
        return max((w.rank for w in layers if w is not None), default=0)

    @property
    def max_rank(self) -> int:
        return max((self.module_rank(m) for m in self.modules), default=0)
