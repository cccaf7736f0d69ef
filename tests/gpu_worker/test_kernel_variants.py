"""The variants file: each build of this package's kernels a line, once; a warm-up builds the lines whose
kernel's code and GPU match. A build needs a GPU, so Triton's post-compile hook is called here with the
arguments JITFunction passes it, and the function a line names is a real Triton JITFunction (its code's key
needs no GPU) whose `preload`, the GPU's part, is stood in for."""
from __future__ import annotations

import json

from triton import knobs
from triton.runtime.jit import JITFunction, JitFunctionInfo

from services.gpu_worker.kernel_builds import watch_builds
from services.gpu_worker.kernel_variants import KernelVariants, keep_variants, resolve_path

SM90 = {"backend": "cuda", "arch": 90, "warp_size": 32}
SM80 = {"backend": "cuda", "arch": 80, "warp_size": 32}


def _scale(x_ptr, n):
    pass


def _scale_v2(x_ptr, n, k):
    pass


class Kernel(JITFunction):
    """Triton's JITFunction with the GPU's part, building a variant, kept as a list of what it was asked."""

    def __init__(self, fn, fail_on: str = ""):
        super().__init__(fn)
        self.preloaded: list[str] = []
        self.fail_on = fail_on

    def preload(self, specialization_data):
        if self.fail_on and self.fail_on in specialization_data:
            raise RuntimeError("cannot build")
        self.preloaded.append(json.loads(specialization_data)["key"])
        return object()


def variant(key: str, target=SM90) -> str:
    """Triton's serialized specialization (serialize_specialization_data), the parts read here."""
    return json.dumps({"name": "k", "signature": {"x_ptr": "*bf16"}, "constant_keys": [], "constant_vals": [],
                       "attrs_keys": [], "attrs_vals": [], "options": {"num_warps": 4}, "key": key,
                       "target": target})


def built(variants: KernelVariants, kernel, key: str, module="services.gpu_worker.kernels.lora_shrink",
          target=SM90) -> None:
    variants.record(JitFunctionInfo(module, kernel.fn.__name__, kernel), {"specialization_data": variant(key, target)})


def test_each_variant_of_the_packages_kernels_is_one_line_kept_across_restarts(tmp_path):
    path = tmp_path / "cache" / "variants.jsonl"
    kernel = Kernel(_scale)
    first = KernelVariants(path)
    built(first, kernel, "[('*bf16', 'D'), ('i32', '')]")
    built(first, kernel, "[('*bf16', 'D'), ('i32', '')]")  # built again (another device, say): no new line
    built(first, kernel, "[('*bf16', 'D'), ('i32', 'D')]")
    built(first, kernel, "[('*fp32', 'D')]", module="some.other.package")  # not ours
    first.record(JitFunctionInfo("services.gpu_worker.kernels.rms_norm", "k", kernel), {})  # no variant data
    assert first.recorded == 2
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["kernel"] for line in lines] == ["services.gpu_worker.kernels.lora_shrink:_scale"] * 2
    assert {line["source"] for line in lines} == {kernel.cache_key}
    # A restarted worker knows them: the same build adds nothing; a line cut short by a crash is skipped.
    with open(path, "a") as f:
        f.write('{"kernel": "services.gpu_worker.kernels.lora_shrink:_scale", "sour')
    again = KernelVariants(path)
    assert len(again.entries()) == 2
    built(again, kernel, "[('*bf16', 'D'), ('i32', 'D')]")
    assert again.recorded == 0


def test_a_warm_up_builds_the_lines_of_this_code_and_this_gpu_and_counts_the_rest(tmp_path):
    path = tmp_path / "variants.jsonl"
    old, current = Kernel(_scale), Kernel(_scale_v2, fail_on="broken")
    variants = KernelVariants(path)
    built(variants, old, "written-by-old-code")  # its kernel's code has changed since: not built
    built(variants, current, "a")
    built(variants, current, "b")
    built(variants, current, "other-arch", target=SM80)
    built(variants, current, "broken")
    names = {"services.gpu_worker.kernels.lora_shrink:_scale": current,  # the same name now runs new code
             "services.gpu_worker.kernels.lora_shrink:_scale_v2": current}
    counts = KernelVariants(path).build_all(threads=1, resolve=names.get, target=SM90)
    assert current.preloaded == ["a", "b"]
    assert {k: counts[k] for k in ("built", "stale", "other_gpu", "failed")} == {
        "built": 2, "stale": 1, "other_gpu": 1, "failed": 1}
    assert counts["seconds"] >= 0
    # A kernel no longer in the package is stale too.
    assert KernelVariants(path).build_all(threads=1, resolve=lambda name: None, target=SM90)["stale"] == 5


def test_the_workers_setting_and_its_watcher_record_builds_met_through_tritons_hooks(tmp_path, monkeypatch):
    assert resolve_path("off") is None
    assert resolve_path(str(tmp_path / "v.jsonl")) == tmp_path / "v.jsonl"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert resolve_path("auto") == tmp_path / "triton" / "loraplex-kernel-variants.jsonl"
    watcher = watch_builds()
    listeners = list(watcher.listeners)
    try:
        variants = keep_variants("auto")
        kernel = Kernel(_scale)
        info = JitFunctionInfo("services.gpu_worker.kernels.write_kv", "_scale", kernel)
        extra = {"repr": "_scale[num_warps=4]", "compile": {"key": "k1", "specialization_data": variant("k1")},
                 "is_manual_warmup": False, "already_compiled": False}
        # What JITFunction._do_compile calls around a build.
        knobs.runtime.jit_cache_hook(key="k1", fn=info, **extra)
        knobs.runtime.jit_post_compile_hook(key="k1", fn=info, **extra)
        assert variants.recorded == 1
        line = json.loads(variants.path.read_text())
        assert line["kernel"] == "services.gpu_worker.kernels.write_kv:_scale"
        assert json.loads(line["variant"])["key"] == "k1"
    finally:
        watcher.listeners[:] = listeners
