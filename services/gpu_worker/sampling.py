"""Next-token choice per request: greedy, or temperature with top-k / top-p, from a per-request generator."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflows fp32 (a denormal becomes 0): the limit
        # of sampling as temperature -> 0 is the argmax anyway.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of fp32 logits; masked entries -inf."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False  # a top_p below fp32's smallest value compares as 0 and would drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class GreedyTokens:
    """Argmax of every row, copied to host memory asynchronously; `tolist` waits for it."""

    def __init__(self, logits: torch.Tensor):
        ids = logits.argmax(dim=-1).to(torch.int32)
        self.device_ids = ids  # the next step may read them on the device before the host sees them
        if ids.is_cuda:
            self.host = torch.empty(ids.shape, dtype=torch.int32, pin_memory=True)
            self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = ids, None

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def finish_sampling(greedy: GreedyTokens, logits: torch.Tensor, params: list[SamplingParams],
                    generators: list[torch.Generator | None]) -> list[int]:
    """Greedy rows from the argmax copy; other rows drawn on the host from their own generator."""
    out = greedy.tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i].float().cpu(), p), dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [N, vocab]. Greedy rows share one argmax (one device sync)."""
    return finish_sampling(GreedyTokens(logits), logits, params, generators)
