"""Triton kernel variants built in this process while it runs, by kernel, through Triton's JIT hooks.

A kernel called with a specialization its process has not met yet (other constexprs, an int newly 1 or
divisible by 16, a pointer newly aligned, another dtype) is built at that call: compiled, or loaded from
Triton's disk cache, while the host issues a step and the GPU waits for it. Warm-up builds what it reaches;
what traffic meets later is built under load: on an H100 the engine alone met 26 builds in a 20 s window after
20 s of traffic, 9.1 s of them (docs/benchmarks.md, 2026-12-06 16:35). The engine counts the builds inside each
step (step_stats.py); each build's variant (its constexprs and specialized arguments) is kept to tell which
shapes warm-up missed. Triton calls `jit_cache_hook` before a build and `jit_post_compile_hook` after it; hooks
installed before these are still called. Without those hooks (a Triton before its `knobs`) nothing is
counted and `summary()` is None.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict

VARIANT_CHARS = 800  # of a build's description kept (its constexprs and specialized arguments)
VARIANTS_SHOWN = 6  # per kernel, in a summary


class KernelBuilds:
    def __init__(self) -> None:
        self.builds: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.variants: list[tuple[str, str]] = []  # (kernel, variant) of each build, in order
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
        took = time.perf_counter() - started if started is not None else 0.0
        self.builds[fn.name] += 1
        self.seconds[fn.name] += took
        self.variants.append((fn.name, _variant(kwargs)))
        after = self._previous[1]
        return after(key=key, fn=fn, **kwargs) if after else None

    def totals(self) -> tuple[int, float]:
        """Builds of every kernel and their seconds: what the engine reads around each step it issues."""
        return len(self.variants), sum(self.seconds.values())

    def snapshot(self) -> tuple[Counter, dict, int]:
        return Counter(self.builds), dict(self.seconds), len(self.variants)

    def summary(self, since: tuple[Counter, dict, int] | None = None) -> dict | None:
        """Builds and their seconds, in all and by kernel, since `since` (a snapshot) or since installed, with
        the first few variants built of each kernel."""
        if not self.installed:
            return None
        builds, seconds, first = since or (Counter(), {}, 0)
        by_kernel = {name: {"builds": n - builds.get(name, 0),
                            "seconds": round(self.seconds[name] - seconds.get(name, 0.0), 3)}
                     for name, n in self.builds.most_common() if n > builds.get(name, 0)}
        for name, variant in self.variants[first:]:
            shown = by_kernel[name].setdefault("variants", [])
            if len(shown) < VARIANTS_SHOWN:
                shown.append(variant)
        return {"builds": sum(k["builds"] for k in by_kernel.values()),
                "seconds": round(sum(k["seconds"] for k in by_kernel.values()), 3), "by_kernel": by_kernel}


def _variant(hook_kwargs: dict) -> str:
    """What sets a build apart from the kernel's others: Triton's description of the call (its arguments'
    types and the launch options), its constexprs and which arguments it specialized on."""
    compiled = hook_kwargs.get("compile") or {}
    parts = [str(hook_kwargs.get("repr", ""))]
    for name in ("constants", "configs"):
        if compiled.get(name) is not None:
            parts.append(f"{name}={compiled[name]}")
    return " ".join(parts)[:VARIANT_CHARS]


_WATCHING: KernelBuilds | None = None


def watch_builds() -> KernelBuilds:
    """This process's one watcher, installed at the first call: engines and benchmarks read the same counts."""
    global _WATCHING
    if _WATCHING is None:
        _WATCHING = KernelBuilds()
    if not _WATCHING.installed:
        _WATCHING.install()
    return _WATCHING
