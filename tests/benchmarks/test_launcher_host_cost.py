"""The launchers' host-cost benchmark runs the real launchers on the CPU with the Triton launch left out, and
puts the kernels back afterwards."""
from __future__ import annotations

import importlib

from benchmarks.kernels.launcher_host_cost import launches_recorded, measure


def test_host_cost_is_measured_on_the_real_launchers_and_the_kernels_come_back():
    shrink = importlib.import_module("services.gpu_worker.kernels.lora_shrink")
    kernel = shrink._shrink_segment_kernel
    result = measure(calls=20, tokens=256, segments=8)
    assert result["lora_shrink_us"] > 0 and result["lora_expand_us"] > 0
    # Every call reached its kernel launch (22 = 20 timed + 2 warm-up), so the checks before it all passed.
    assert result["launches"] == {"_shrink_segment_kernel": 22, "_expand_segment_kernel": 22}
    assert shrink._shrink_segment_kernel is kernel
    with launches_recorded() as recorded:
        assert shrink._shrink_segment_kernel is recorded["_shrink_segment_kernel"]
    assert shrink._shrink_segment_kernel is kernel
