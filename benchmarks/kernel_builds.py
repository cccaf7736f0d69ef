"""Triton kernel variants built in this process while it runs, by kernel, through Triton's JIT hooks.

A kernel called with a specialization its process has not met yet (other constexprs, an int newly 1 or
divisible by 16, another dtype) is built at that call: compiled, or loaded from Triton's disk cache, while the
host issues a step and the GPU waits for it. Warm-up builds what it reaches; what traffic meets later is built
under load. Counting the builds inside a measured window tells whether they stand between a step's kernels.
Triton calls `jit_cache_hook` before a build and `jit_post_compile_hook` after it; hooks installed before these
are still called. Without those hooks (a Triton before its `knobs`) nothing is counted and `summary()` is None.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict


class KernelBuilds:
    def __init__(self) -> None:
        self.builds: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._started: dict[tuple[str, str], float] = {}
        self._previous = (None, None)
        self.installed = False

    def install(self) -> bool:
        """Hook Triton's builds; False where this Triton has no such hooks."""
        try:
            from triton import knobs
            runtime = knobs.runtime
            self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return False
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        self.installed = True
        return True

    def uninstall(self) -> None:
        if self.installed:
            from triton import knobs
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous
            self.installed = False

    def _before(self, *, key, fn, **kwargs):
        self._started[(fn.name, str(key))] = time.perf_counter()
        before = self._previous[0]
        # A true answer from an earlier hook skips the build: it is then not counted.
        skip = before(key=key, fn=fn, **kwargs) if before else None
        if skip:
            self._started.pop((fn.name, str(key)), None)
        return skip

    def _after(self, *, key, fn, **kwargs):
        started = self._started.pop((fn.name, str(key)), None)
        self.builds[fn.name] += 1
        if started is not None:
            self.seconds[fn.name] += time.perf_counter() - started
        after = self._previous[1]
        return after(key=key, fn=fn, **kwargs) if after else None

    def snapshot(self) -> tuple[Counter, dict]:
        return Counter(self.builds), dict(self.seconds)

    def summary(self, since: tuple[Counter, dict] | None = None) -> dict | None:
        """Builds and their seconds, in all and by kernel, since `since` (a snapshot) or since installed."""
        if not self.installed:
            return None
        builds, seconds = since or (Counter(), {})
        by_kernel = {name: {"builds": n - builds.get(name, 0),
                            "seconds": round(self.seconds[name] - seconds.get(name, 0.0), 3)}
                     for name, n in self.builds.most_common() if n > builds.get(name, 0)}
        return {"builds": sum(k["builds"] for k in by_kernel.values()),
                "seconds": round(sum(k["seconds"] for k in by_kernel.values()), 3), "by_kernel": by_kernel}
