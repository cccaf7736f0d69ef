"""Moving averages of arrivals (R1) and admissions (R2) per scheduling period, as S-LoRA keeps them.

R1 > R2 means requests arrive faster than the workers take them: the queue grows and the scheduler
switches to newest-first, so the requests that can still meet the first-token SLO are the ones served.
"""
from __future__ import annotations


class RateMonitor:
    def __init__(self, period_s: float = 0.5, smoothing: float = 0.3, now: float = 0.0):
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.period_s = period_s
        self.smoothing = smoothing
        self.arrivals_avg = 0.0  # R1, requests per period
        self.admissions_avg = 0.0  # R2, requests per period
        self._period_start = now
        self._arrivals = 0
        self._admissions = 0

    def _roll(self, now: float) -> None:
        """Fold every period that ended before `now` into the averages; idle periods count as zeros."""
        elapsed = int((now - self._period_start) // self.period_s)
        if elapsed <= 0:
            return
        a = self.smoothing
        self.arrivals_avg += a * (self._arrivals - self.arrivals_avg)
        self.admissions_avg += a * (self._admissions - self.admissions_avg)
        # Further empty periods decay both averages geometrically; cap the loop for long idle gaps.
        decay = (1 - a) ** min(elapsed - 1, 1000)
        self.arrivals_avg *= decay
        self.admissions_avg *= decay
        self._arrivals = self._admissions = 0
        self._period_start += elapsed * self.period_s

    def record_arrival(self, now: float, n: int = 1) -> None:
        self._roll(now)
        self._arrivals += n

    def record_admission(self, now: float, n: int = 1) -> None:
        self._roll(now)
        self._admissions += n

    def overloaded(self, now: float) -> bool:
        self._roll(now)
        return self.arrivals_avg > self.admissions_avg

    def service_rate(self, now: float) -> float:
        """Admissions per second, the rate at which a queued request moves towards a worker."""
        self._roll(now)
        return self.admissions_avg / self.period_s
