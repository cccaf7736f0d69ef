"""The LoRA launch-cost benchmark runs end to end on the CPU (Triton's interpreter, tiny shapes)."""
from __future__ import annotations

import re
import sys

from benchmarks.lora_launch_cost import main


def test_launch_cost_reports_every_row_and_puts_the_kernels_back(tmp_path):
    out = tmp_path / "cost.txt"
    assert main(["--tiny", "--out", str(out)]) == 0
    rows = dict((name.strip(), float(us)) for name, us in re.findall(r"^  (.+?)\s+([0-9.]+)$", out.read_text(), re.M))
    assert len(rows) == 10 and all(us > 0 for us in rows.values())
    # The stubbed launcher does no kernel work, so it is cheaper than the call that launches the kernel.
    assert rows["lora_shrink, launcher only (kernels stubbed)"] < rows["lora_shrink (q,k,v), without a plan"]
    shrink = sys.modules["services.gpu_worker.kernels.lora_shrink"]
    assert type(shrink._shrink_segment_kernel).__name__ != "_NoLaunch"
