"""KV slots that admission keeps free for the decode tokens of requests already running.

A request admitted because its prompt fits now takes slots that the running requests' next tokens may need;
when the pool runs out, the newest request is preempted and later recomputed, prompt and output, which costs
a whole prefill for tokens already computed once (S2 n = 2000 on an 80 GB card: ~1,100 preemptions in 140 s).
Admission therefore keeps back a share of the slots the running requests would take to reach their max_tokens
(and of the candidate's own). The share is an estimate of how much of max_tokens requests will really use:
it jumps to `high` at every preemption (the estimate was too low) and eases linearly to `low` over `ease_s`
seconds without one, so a pool that never runs short loses almost nothing to it.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable


class DecodeReserve:
    def __init__(self, high: float, low: float, ease_s: float, clock: Callable[[], float] = time.monotonic):
        if not 0 <= low <= high <= 1:
            raise ValueError(f"decode reserve shares must satisfy 0 <= low <= high <= 1, got low={low!r}, "
                             f"high={high!r}")
        self.high, self.low, self.ease_s = high, low, ease_s
        self._clock = clock
        self._raised_at = clock()  # a fresh engine knows nothing of its traffic: start from the high share

    def share(self) -> float:
        """The share of the remaining output tokens kept back now."""
        if self.ease_s <= 0:
            return self.low
        eased = (self._clock() - self._raised_at) / self.ease_s
        return max(self.low, self.high - (self.high - self.low) * eased)

    def preempted(self) -> None:
        self._raised_at = self._clock()

    @staticmethod
    def remaining_output(max_tokens: int, num_output: int, context: int, max_model_len: int) -> int:
        """Tokens a request may still add to its context: up to max_tokens, within the context length."""
        return max(0, min(max_tokens - num_output, max_model_len - context))

    @staticmethod
    def slots(remaining: Iterable[int], share: float) -> int:
        """Slots kept back, at `share`, for requests with these remaining output tokens."""
        return math.ceil(share * sum(remaining))
