"""S-LoRA early abort: drop queued requests that can no longer meet the first-token SLO.

A request r is hopeless when `now - arrival(r) + est_prefill(r) > slo`: even if it were scheduled this
instant its first token would come too late. Serving it would only spend capacity that requests which
can still make it need, so it is answered at once (the client can retry) instead.
"""
from __future__ import annotations

from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


class PrefillEstimator:
    """Seconds from assignment to first token for a prompt of n tokens: `overhead + n * per_token`.

    Starts from configured values and follows what the workers actually do: every observed first token
    updates the per-token cost by an exponential moving average.
    """

    def __init__(self, overhead_s: float = 0.02, per_token_s: float = 1e-4, smoothing: float = 0.2):
        if overhead_s < 0 or per_token_s < 0:
            raise ValueError("prefill estimate terms must be >= 0")
        self.overhead_s = overhead_s
        self.per_token_s = per_token_s
        self.smoothing = smoothing
        self.longest_prompt = 0

    def estimate(self, prompt_tokens: int) -> float:
        return self.overhead_s + prompt_tokens * self.per_token_s

    def note_prompt(self, prompt_tokens: int) -> None:
        self.longest_prompt = max(self.longest_prompt, prompt_tokens)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A request of `prompt_tokens` took `seconds` from assignment to its first token."""
        if prompt_tokens <= 0 or seconds <= 0:
            return
        sample = max(0.0, seconds - self.overhead_s) / prompt_tokens
        self.per_token_s += self.smoothing * (sample - self.per_token_s)


def hopeless(queue: WaitingQueue, now: float, slo_s: float, estimator: PrefillEstimator) -> list[QueuedRequest]:
    """Queued requests that cannot meet the SLO, found without scanning the whole queue.

    Walks each tenant's fresh requests oldest first and stops at the first one that could still make it
    even with the longest prompt seen: every younger one has waited less, so none of them is hopeless yet.
    Requeued requests are exempt: they were admitted long ago and are owed an answer from a worker.
    """
    if slo_s <= 0:
        return []
    worst = estimator.estimate(estimator.longest_prompt)
    out = []
    for tenant in queue.tenants():
        for request in queue.lane(tenant):
            waited = now - request.arrival
            if waited + worst <= slo_s:
                break
            if waited + estimator.estimate(request.prompt_tokens) > slo_s:
                out.append(request)
    return out
