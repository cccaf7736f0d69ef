"""The Triton kernel variants a worker has built, kept in a file and built again at the next warm-up.

Warm-up reaches the kernel variants of the shapes it runs; traffic meets others (an admission step mixing a
full batch's decode tokens with a round's prompts tiles its LoRA launches otherwise), and builds them under
load at ~300 ms each while the GPU waits: after the worker's own warm-up, the engine alone still built 6 in a
20 s window on an H100 (1.8 s; docs/benchmarks.md, 2026-12-06 18:37). Each variant a worker builds is one line
here (Triton's own description of it: signature, constexprs, specialized arguments, options, target), and the
next worker's warm-up builds every line first, from Triton's disk cache when it is kept (docker-compose's
`triton-cache` volume holds both), so the traffic after it meets none of them.

A line names its kernel's source (Triton's cache key of the function and what it calls): one written by other
kernel code is skipped, never built as a variant of code it was not taken from. Lines for another GPU
architecture are skipped too. Only this package's kernels are kept. JSON only; nothing here is executed.
"""
from __future__ import annotations

import importlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.log import get_logger

log = get_logger(__name__)

KERNELS_PACKAGE = "services.gpu_worker.kernels"
FILE_NAME = "loraplex-kernel-variants.jsonl"
BUILD_THREADS = 8  # Triton's compiler passes and ptxas run outside the GIL: a warm-up builds several at once


def default_path() -> Path:
    """Beside Triton's cache (TRITON_CACHE_DIR, else ~/.triton/cache), so the two are kept or lost together."""
    try:
        from triton import knobs
        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        cache_dir = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return Path(cache_dir) / FILE_NAME


def resolve_path(setting: str) -> Path | None:
    """The worker's `kernel_variants` setting: auto (beside Triton's cache), off, or a file."""
    if setting == "off":
        return None
    return default_path() if setting in ("", "auto") else Path(setting)


def keep_variants(setting: str) -> KernelVariants | None:
    """The worker's variants file (its `kernel_variants` setting), recording every build from now on."""
    path = resolve_path(setting)
    if path is None:
        return None
    from .kernel_builds import watch_builds
    variants = KernelVariants(path)
    watch_builds().listeners.append(variants.record)
    return variants


def source_key(jit_function) -> str:
    """What identifies the kernel's code: Triton's cache key of the function (its source and its callees')."""
    return str(getattr(jit_function, "cache_key", ""))


def _module_name(module) -> str:
    return module if isinstance(module, str) else getattr(module, "__name__", "")


class KernelVariants:
    """The variants file: `record` (a KernelBuilds listener) appends each new build of this package's
    kernels; `build_all` builds every line that still matches its kernel's code."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.known: set[tuple[str, str, str]] = {self._identity(e) for e in self.entries()}
        self.recorded = 0  # lines this process added
        self.built: dict | None = None  # build_all's counts

    @staticmethod
    def _identity(entry: dict) -> tuple[str, str, str]:
        return entry["kernel"], entry["source"], str(json.loads(entry["variant"]).get("key"))

    def entries(self) -> list[dict]:
        """The file's well-formed lines, in order (a line cut short by a crash is skipped)."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                entry = json.loads(line)
                if isinstance(entry, dict) and {"kernel", "source", "variant"} <= entry.keys():
                    json.loads(entry["variant"])
                    out.append(entry)
            except (ValueError, TypeError):
                continue
        return out

    def record(self, fn, compiled: dict) -> None:
        """One build (Triton's post-compile hook arguments): a line unless it is known or not ours."""
        module = _module_name(getattr(fn, "module", ""))
        variant = compiled.get("specialization_data")
        if not module.startswith(KERNELS_PACKAGE) or not variant:
            return
        entry = {"kernel": f"{module}:{fn.name}", "source": source_key(fn.jit_function), "variant": variant}
        identity = self._identity(entry)
        if identity in self.known:
            return
        self.known.add(identity)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write of a whole line in append mode: workers sharing the file do not interleave their lines.
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        self.recorded += 1

    def build_all(self, threads: int = BUILD_THREADS, resolve=None, target: dict | None = None) -> dict:
        """Build every line whose kernel's code and GPU architecture match; returns counts and seconds.
        `resolve` finds a line's JIT function by name (this package's kernels by default), `target` is the GPU's
        (Triton's for the current device by default)."""
        started = time.perf_counter()
        resolve = resolve or _kernel
        counts = {"built": 0, "stale": 0, "other_gpu": 0, "failed": 0}
        todo = []
        for entry in self.entries():
            kernel = resolve(entry["kernel"])
            if kernel is None or source_key(kernel) != entry["source"]:
                counts["stale"] += 1
                continue
            if target is None:
                target = _current_target()
            if json.loads(entry["variant"]).get("target") != target:
                counts["other_gpu"] += 1
            else:
                todo.append((kernel, entry["variant"]))
        for ok in _build(todo, threads) if todo else ():
            counts["built" if ok else "failed"] += 1
        counts["seconds"] = round(time.perf_counter() - started, 2)
        log.info("worker.kernel_variants_built", path=str(self.path), **counts)
        self.built = counts
        return counts


def _kernel(name: str):
    """The JIT function named `module:qualname`, from this package only."""
    module, _, attr = name.partition(":")
    if not module.startswith(KERNELS_PACKAGE):
        return None
    try:
        kernel = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None
    return kernel if hasattr(kernel, "preload") else None


def _current_target() -> dict:
    """The current device's compile target (backend, architecture, warp size), as Triton writes it in a variant."""
    from triton.runtime import driver
    return driver.active.get_current_target().__dict__


def _build(todo: list, threads: int) -> list[bool]:
    """Each (kernel, variant) built through Triton's preload: in a thread pool under Triton's asynchronous
    compile where this Triton has it, one after another otherwise."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
    except ImportError:
        AsyncCompileMode = FutureKernel = None
    if AsyncCompileMode is None or threads <= 1:
        return [_preload(kernel, variant) is not None for kernel, variant in todo]
    with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool, ignore_errors=True):
        pending = [_preload(kernel, variant) for kernel, variant in todo]
    built = [p is not None and p.result(ignore_errors=True) is not None for p in pending]
    # Triton's caches now hold each variant as a future: the compiled kernel itself goes in its place, which
    # is what a launch expects to find (compiled_launch.py launches a CompiledKernel directly).
    for kernel in {id(k): k for k, _ in todo}.values():
        for caches in kernel.device_caches.values():
            cache = caches[0]
            for key, found in list(cache.items()):
                if isinstance(found, FutureKernel):
                    compiled = found.result(ignore_errors=True)
                    if compiled is None:
                        del cache[key]  # failed: built again at its first call
                    else:
                        cache[key] = compiled
    return built


def _preload(kernel, variant: str):
    try:
        return kernel.preload(variant)
    except Exception as e:  # noqa: BLE001 (a line Triton cannot build any more is skipped, not fatal)
        log.warning("worker.kernel_variant_failed", kernel=getattr(kernel, "__name__", str(kernel)), error=str(e)[:200])
        return None
