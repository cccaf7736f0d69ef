"""S-LoRA early abort: drop queued requests that can no longer meet the first-token SLO.

A request r is hopeless when `now - arrival(r) + est_prefill(r) > slo`: even if it were scheduled this
instant its first token would come too late. Serving it would only spend capacity that requests which
can still make it need, so it is answered at once (the client can retry) instead.
"""
from __future__ import annotations

from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


class PrefillEstimator:
    """Seconds from assignment to first token for a prompt of n tokens, learned from what the workers do.

    Each observed first token is a sample (prompt tokens, seconds). The estimate is an exponentially
    weighted least-squares line through them, `mean_s + slope * (n - mean_n)`. Most of those seconds are
    not the request's own prefill: it waits at the worker for a place in the batch, and its first token
    comes at the end of a step that prefills the whole admission round. A per-token cost taken from each
    sample on its own (seconds / n) would charge that wait to the prompt's length: an 8-token prompt that
    waited 1 s reads as 0.12 s a token, the estimate for a long prompt swings past the SLO, and requests
    that just arrived are aborted as hopeless. The line puts the shared wait in its level and only what
    grows with the prompt in its slope. Until the samples' prompt lengths spread, the slope is the
    configured one.
    """

    # Prompt lengths must spread this much (variance, tokens^2) before the fitted slope is trusted.
    MIN_SPREAD = 16.0

    # smoothing 0.05: about the last 20 first tokens, a second's worth at the rates a busy worker serves.
    def __init__(self, overhead_s: float = 0.02, per_token_s: float = 1e-4, smoothing: float = 0.05):
        if overhead_s < 0 or per_token_s < 0:
            raise ValueError("prefill estimate terms must be >= 0")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.overhead_s = overhead_s
        self.prior_per_token_s = per_token_s
        self.smoothing = smoothing
        self.longest_prompt = 0
        self.samples = 0
        self.mean_n = 0.0
        self.mean_s = 0.0
        self.var_n = 0.0
        self.cov_ns = 0.0

    @property
    def per_token_s(self) -> float:
        """The line's slope: seconds each further prompt token adds (never negative)."""
        if self.var_n < self.MIN_SPREAD:
            return self.prior_per_token_s
        return max(0.0, self.cov_ns / self.var_n)

    def estimate(self, prompt_tokens: int) -> float:
        if self.samples == 0:
            return self.overhead_s + prompt_tokens * self.prior_per_token_s
        return max(0.0, self.mean_s + self.per_token_s * (prompt_tokens - self.mean_n))

    def longest_estimate(self) -> float:
        """The estimate for the longest prompt seen: no queued request needs longer."""
        return self.estimate(self.longest_prompt)

    def note_prompt(self, prompt_tokens: int) -> None:
        self.longest_prompt = max(self.longest_prompt, prompt_tokens)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A request of `prompt_tokens` took `seconds` from assignment to its first token."""
        if prompt_tokens <= 0 or seconds < 0:
            return
        self.samples += 1
        if self.samples == 1:
            self.mean_n, self.mean_s = float(prompt_tokens), float(seconds)
            return
        a = self.smoothing
        dn, ds = prompt_tokens - self.mean_n, seconds - self.mean_s
        self.mean_n += a * dn
        self.mean_s += a * ds
        # Exponentially weighted (co)variance, updated in one pass (West's incremental form).
        self.var_n = (1 - a) * (self.var_n + a * dn * dn)
        self.cov_ns = (1 - a) * (self.cov_ns + a * dn * ds)


def hopeless(queue: WaitingQueue, now: float, slo_s: float, estimator: PrefillEstimator) -> list[QueuedRequest]:
    """Queued requests that cannot meet the SLO, found without scanning the whole queue.

    Walks each tenant's fresh requests oldest first and stops at the first one that could still make it
    even with the longest prompt seen: every younger one has waited less, so none of them is hopeless yet.
    Requeued requests are exempt: they were admitted long ago and are owed an answer from a worker.
    """
    if slo_s <= 0:
        return []
    worst = estimator.longest_estimate()
    out = []
    for tenant in queue.tenants():
        for request in queue.lane(tenant):
            waited = now - request.arrival
            if waited + worst <= slo_s:
                break
            if waited + estimator.estimate(request.prompt_tokens) > slo_s:
                out.append(request)
    return out
