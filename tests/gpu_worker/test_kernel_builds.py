"""Kernel builds are counted through Triton's own JIT hooks, called here with the arguments Triton's
JITFunction passes them (a build needs a GPU; the CPU interpreter builds nothing)."""
from __future__ import annotations

import time

import pytest

from triton import knobs
from triton.runtime.jit import JitFunctionInfo

from services.gpu_worker.kernel_builds import KernelBuilds, watch_builds


def build(kernel: str, key, seconds: float = 0.0, constants=None) -> None:
    """What JITFunction._do_compile does around one build: the cache hook, the build, the post-compile hook."""
    info = JitFunctionInfo("services.gpu_worker.kernels", kernel, None)
    extra = {"repr": f"{kernel}[num_warps=4]", "compile": {"key": key, "constants": constants or {}},
             "is_manual_warmup": False, "already_compiled": False}
    if knobs.runtime.jit_cache_hook(key=key, fn=info, **extra):
        return  # an earlier hook answered: no build
    time.sleep(seconds)
    knobs.runtime.jit_post_compile_hook(key=key, fn=info, **extra)


def test_builds_are_counted_by_kernel_with_their_seconds_and_the_hooks_put_back():
    found = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)  # the process's own watcher's
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
        build("lora_shrink_kernel", ("i32", 1), seconds=0.02, constants={(20,): 64})
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
        shrink_s = window["by_kernel"]["lora_shrink_kernel"]["seconds"]
        assert 0.02 <= shrink_s < whole["by_kernel"]["lora_shrink_kernel"]["seconds"]
        # Each build's variant: Triton's description of the call with its constexprs, the window's own alone.
        assert window["by_kernel"]["lora_shrink_kernel"]["variants"] == [
            "lora_shrink_kernel[num_warps=4] constants={(20,): 64}"]
        assert len(whole["by_kernel"]["lora_shrink_kernel"]["variants"]) == 2
        count, seconds = builds.totals()
        assert count == 3 and seconds == pytest.approx(sum(builds.seconds.values())) and seconds >= 0.04
        builds.uninstall()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == earlier
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = found


def test_without_earlier_hooks_builds_are_counted_alone():
    found = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    builds = KernelBuilds()
    assert builds.install()
    try:
        build("silu_mul_kernel", ("bf16",))
        summary = builds.summary()
        assert summary["builds"] == 1 and list(summary["by_kernel"]) == ["silu_mul_kernel"]
        builds.uninstall()
        assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = found


def test_the_process_watches_builds_once_for_every_engine():
    first = watch_builds()
    assert first.installed and watch_builds() is first
    assert knobs.runtime.jit_cache_hook == first._before
    before = first.totals()[0]
    build("write_kv_kernel", ("bf16",))
    assert watch_builds().totals()[0] == before + 1
    first.uninstall()
    assert watch_builds() is first and first.installed  # put back where something took it off


def test_an_engine_counts_the_builds_met_while_a_step_is_issued_in_that_steps_kind(tmp_path):
    """The CPU's interpreter builds nothing, so the build Triton's JIT would run inside the step's forward on a
    GPU (a variant warm-up missed) is played through the same hooks from there."""
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.requests import EngineRequest
    from services.gpu_worker.sampling import SamplingParams
    from shared.config import EngineConfig
    from shared.tiny_model import make_model

    engine = Engine.from_model_dir(make_model(tmp_path / "model", preset="tiny", seed=1), EngineConfig())
    forward = engine.model.forward
    built = []

    def forward_meeting_a_new_variant(batch, pool):
        if not built:  # the first step alone (the prompt's): later ones find it built
            build("_attention_kernel", ("bf16", len(built)), seconds=0.03, constants={(9,): 64})
            built.append(1)
        return forward(batch, pool)

    engine.model.forward = forward_meeting_a_new_variant
    engine.add_request(EngineRequest("r0", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    stats = engine.step_stats
    assert stats.builds["prefill"] == 1 and stats.build_seconds["prefill"] >= 0.03
    assert stats.builds["decode"] == 0 and stats.steps["decode"] == 2  # the decode steps built nothing
    assert engine.kernel_builds.builds["_attention_kernel"] >= 1
