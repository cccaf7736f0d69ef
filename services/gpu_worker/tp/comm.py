"""The collectives of a tensor-parallel forward, each counted by kind.

Counts use the bandwidth-optimal (ring) cost model, the one the S-LoRA paper's traffic formula assumes:
an all-reduce of S elements sends 2·(N−1)/N·S elements from every rank, an all-gather whose result holds S
elements sends (N−1)/N·S. Kinds:
  base_all_reduce  the Megatron all-reduce after each row-parallel layer (o, down); it also carries the
                   row-parallel LoRA output slices, fused, at no extra cost
  lora_all_gather  column-parallel LoRA shrink outputs (q/k/v fused, gate/up fused), (T, r/N) -> (T, r)
  lora_all_reduce  row-parallel LoRA shrink partial sums (o, down), (T, r)
Exact fractions, so tests compare counts to formulas without tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

BASE_ALL_REDUCE = "base_all_reduce"
LORA_ALL_GATHER = "lora_all_gather"
LORA_ALL_REDUCE = "lora_all_reduce"
KINDS = (BASE_ALL_REDUCE, LORA_ALL_GATHER, LORA_ALL_REDUCE)


@dataclass
class KindTraffic:
    calls: int = 0
    payload_elements: int = 0  # size of the reduced / gathered tensors
    sent_elements: Fraction = Fraction(0)  # per rank, ring model
    sent_bytes: Fraction = Fraction(0)

    def add(self, payload: int, factor: Fraction, element_size: int) -> None:
        self.calls += 1
        self.payload_elements += payload
        self.sent_elements += factor * payload
        self.sent_bytes += factor * payload * element_size

    def as_dict(self) -> dict:
        return {"calls": self.calls, "payload_elements": self.payload_elements,
                "sent_elements": float(self.sent_elements), "sent_bytes": float(self.sent_bytes)}


@dataclass
class Traffic:
    """Collective traffic by kind; `reset()` at the start of each step gives per-step numbers."""

    kinds: dict[str, KindTraffic] = field(default_factory=lambda: {k: KindTraffic() for k in KINDS})

    def __getitem__(self, kind: str) -> KindTraffic:
        return self.kinds[kind]

    def reset(self) -> None:
        self.kinds = {k: KindTraffic() for k in KINDS}

    def merge(self, other: "Traffic") -> None:
        for k, t in other.kinds.items():
            mine = self.kinds[k]
            mine.calls += t.calls
            mine.payload_elements += t.payload_elements
            mine.sent_elements += t.sent_elements
            mine.sent_bytes += t.sent_bytes

    @property
    def lora_sent_bytes(self) -> Fraction:
        return self.kinds[LORA_ALL_GATHER].sent_bytes + self.kinds[LORA_ALL_REDUCE].sent_bytes

    def as_dict(self) -> dict:
        return {k: t.as_dict() for k, t in self.kinds.items()}


class TPComm:
    """Collectives over the tensor-parallel group (gloo on CPU, NCCL on GPUs); no-ops for a group of one."""

    def __init__(self, size: int, group=None, use_list_gather: bool = True):
        self.size = size
        self.group = group
        # gloo cannot all-gather into one flat tensor on every torch release we support; NCCL prefers it.
        self.use_list_gather = use_list_gather
        self.traffic = Traffic()

    def all_reduce(self, t: torch.Tensor, kind: str) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        self.traffic[kind].add(t.numel(), Fraction(2 * (self.size - 1), self.size), t.element_size())
        dist.all_reduce(t, group=self.group)

    def all_gather(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """`[N, *t.shape]`: every rank's `t`, in rank order."""
        if self.size == 1:
            return t.unsqueeze(0)
        import torch.distributed as dist

        t = t.contiguous()
        self.traffic[kind].add(t.numel() * self.size, Fraction(self.size - 1, self.size), t.element_size())
        if self.use_list_gather:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t, group=self.group)
            return torch.stack(parts)
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), t.view(-1), group=self.group)
        return out
