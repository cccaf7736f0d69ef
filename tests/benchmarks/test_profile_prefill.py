"""The prefill profile runs end to end on the CPU (tiny model): both modes prefilled and profiled."""
from __future__ import annotations

import re

from benchmarks.profile_prefill import main


def test_prefill_profile_reports_both_modes(tmp_path):
    out = tmp_path / "prefill.txt"
    assert main(["--model", "tiny", "--requests", "4", "--prompt-max", "40", "--repeats", "2", "--out", str(out)]) == 0
    text = out.read_text()
    steps = dict(re.findall(r"== (base|lora): prefill step ([0-9.]+) ms", text))
    assert set(steps) == {"base", "lora"} and all(float(v) > 0 for v in steps.values())
    launched = dict(re.findall(r"== (base|lora): prefill step [0-9.]+ ms .*launched by the host in ([0-9.]+) ms", text))
    assert set(launched) == {"base", "lora"} and all(0 < float(launched[m]) <= float(steps[m]) + 1 for m in launched)
    assert text.count("Self CPU") >= 2  # a profiler table under each
    assert re.search(r"round of 4 requests, \d+ prompt tokens", text)


def test_the_round_can_be_admitted_beside_a_running_batch(tmp_path):
    out = tmp_path / "prefill.txt"
    assert main(["--model", "tiny", "--requests", "4", "--prompt-max", "40", "--repeats", "2", "--running", "6",
                 "--adapters", "3", "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"round of 4 requests, \d+ prompt tokens, beside 6 running", text)
    assert set(re.findall(r"== (base|lora): prefill step [0-9.]+ ms", text)) == {"base", "lora"}


def test_host_profile_times_each_op_call_of_the_launch(tmp_path):
    out = tmp_path / "prefill.txt"
    assert main(["--model", "tiny", "--requests", "3", "--prompt-max", "40", "--repeats", "2", "--running", "4",
                 "--adapters", "2", "--host-profile", "--out", str(out)]) == 0
    base, lora = out.read_text().split("== lora:")
    for section in (base, lora):
        assert "host launch under cProfile" in section
        assert re.search(r"launch [0-9.]+ ms with each op timed; 0 synchronizing call", section)
        calls = {name: int(n) for name, n in re.findall(r"^  (\w+)\s+(\d+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+$", section,
                                                        re.MULTILINE)}
        assert calls["attention"] == 2  # one call a layer of the tiny model
        assert calls["linear"] >= 2 * 4  # q,k,v, o, gate,up and down of each layer
    assert "lora_shrink" not in base
    # q,k,v and o adapted: two module groups a layer, each one shrink and one expand.
    assert re.search(r"^  lora_shrink\s+4\s", lora, re.MULTILINE) and re.search(r"^  lora_expand\s+4\s", lora, re.MULTILINE)
