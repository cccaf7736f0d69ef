"""Kernel builds are counted through Triton's own JIT hooks, called here with the arguments Triton's
JITFunction passes them (a build needs a GPU; the CPU interpreter builds nothing)."""
from __future__ import annotations

import time

from triton import knobs
from triton.runtime.jit import JitFunctionInfo

from benchmarks.kernel_builds import KernelBuilds


def build(kernel: str, key, seconds: float = 0.0) -> None:
    """What JITFunction._do_compile does around one build: the cache hook, the build, the post-compile hook."""
    info = JitFunctionInfo("services.gpu_worker.kernels", kernel, None)
    extra = {"repr": f"{kernel}[num_warps=4]", "compile": {"key": key}, "is_manual_warmup": False,
             "already_compiled": False}
    if knobs.runtime.jit_cache_hook(key=key, fn=info, **extra):
        return  # an earlier hook answered: no build
    time.sleep(seconds)
    knobs.runtime.jit_post_compile_hook(key=key, fn=info, **extra)


def test_builds_are_counted_by_kernel_with_their_seconds_and_the_hooks_put_back():
    calls = []
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append(("before", kw["fn"].name)) or kw["key"] == "skip"
    knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append(("after", kw["fn"].name))
    earlier = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        builds = KernelBuilds()
        assert builds.summary() is None  # not installed: nothing to say
        assert builds.install()
        build("lora_shrink_kernel", ("i32", 16), seconds=0.02)
        window_opened = builds.snapshot()
        build("lora_shrink_kernel", ("i32", 1), seconds=0.02)
        build("paged_attention_kernel", ("bf16",))
        build("rms_norm_kernel", "skip")  # the earlier hook skips this build: not counted
        # The earlier hooks still saw every call (the skipped build's post-compile hook never runs).
        assert calls == [("before", "lora_shrink_kernel"), ("after", "lora_shrink_kernel"),
                         ("before", "lora_shrink_kernel"), ("after", "lora_shrink_kernel"),
                         ("before", "paged_attention_kernel"), ("after", "paged_attention_kernel"),
                         ("before", "rms_norm_kernel")]
        whole = builds.summary()
        assert whole["builds"] == 3 and list(whole["by_kernel"]) == ["lora_shrink_kernel", "paged_attention_kernel"]
        assert whole["by_kernel"]["lora_shrink_kernel"]["builds"] == 2
        assert whole["by_kernel"]["lora_shrink_kernel"]["seconds"] >= 0.04
        window = builds.summary(window_opened)
        assert window["builds"] == 2 and window["by_kernel"]["lora_shrink_kernel"]["builds"] == 1
        assert 0.02 <= window["by_kernel"]["lora_shrink_kernel"]["seconds"] < whole["by_kernel"]["lora_shrink_kernel"]["seconds"]
        builds.uninstall()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == earlier
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_without_earlier_hooks_builds_are_counted_alone():
    builds = KernelBuilds()
    assert builds.install()
    try:
        build("silu_mul_kernel", ("bf16",))
        summary = builds.summary()
        assert summary["builds"] == 1 and list(summary["by_kernel"]) == ["silu_mul_kernel"]
    finally:
        builds.uninstall()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
