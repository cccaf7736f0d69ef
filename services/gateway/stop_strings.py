"""Stop strings applied to detokenized text.

Text that could still be the beginning of a stop string is held back until the next tokens decide it:
a client must never see the first half of a stop string that the second half then completes.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string appeared (it and what follows are dropped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return buf[:min(hits)]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop string: release what was held."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
