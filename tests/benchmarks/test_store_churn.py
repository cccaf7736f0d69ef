"""benchmarks/store_churn.py end to end on the tiny setting: a real redis-server, a real adapter_store process
and fake workers on real ZeroMQ, with an arena of a few adapters so churn evicts and reloads from disk. The
line it reports must be complete and self-consistent, and nothing it started may outlive it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.store_churn import main
from shared.probes import alive

TINY_ENTRY = 16 * 1024  # arena bytes of a tiny rank-8 adapter in bf16 (2 layers x A,B x 32 slots x 64 wide)
KNOWN_CODES = {"arena_full"}  # the only refusal a small arena may cause; anything else is a failure


def churn_argv(work: Path, out: Path) -> list[str]:
    return ["--setting", "tiny", "--n", "12", "--work-dir", str(work), "--out", str(out), "--quiet",
            "--adapter-budget-gb", "0.00004",  # 40 kB: four distinct weight sets, the other names links
            "--arena-gb", str(5 * TINY_ENTRY / 2**30),  # a few adapters of twelve: acquires evict and reload
            "--workers", "2", "--in-flight", "2", "--hold-ms", "5", "--warmup-s", "0.5", "--seconds", "2"]


@pytest.fixture(scope="module")
def churn(tmp_path_factory):
    work = tmp_path_factory.mktemp("store-churn")
    out = work / "results" / "churn.jsonl"
    return main(churn_argv(work, out)), work, out


def test_line_reports_answers_and_ordered_latencies(churn):
    result, _, _ = churn
    assert result["setting"] == "tiny" and result["n"] == 12
    assert result["answered"] > 0 and result["located"] > 0
    assert result["located"] <= result["answered"] <= result["acquires_sent"]
    assert result["answered_per_s"] == pytest.approx(result["answered"] / result["seconds"], abs=0.01)
    lat = result["latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert 0 < lat["mean"] <= lat["max"]
    assert 0 <= result["loop_silence_ms"] <= result["seconds"] * 1000
    assert result["store_cpu_s"] > 0
    for key in ("date", "command", "cpu_model", "torch", "host"):
        assert result[key]
    assert "--setting tiny" in result["command"]


def test_churn_reloads_adapters_from_disk(churn):
    """Only a few adapters fit, so every adapter pinned that was not resident when churn began was read from
    its blob at least once, and eviction keeps the store reading inside the window too. The counts are the
    store's own (its Pong), so they must agree with what the workers saw."""
    result, _, _ = churn
    assert result["loads_source"] == "store Pong counters"
    assert result["resident_at_start"] < result["n"]
    assert result["distinct_cold_acquired"] > 0
    assert result["loads_total"] >= result["distinct_cold_acquired"]
    assert 0 < result["loads"] <= result["loads_total"]
    # The window's deltas cover the span between the store's answers to the Pings at its edges.
    lag = result["counters_lag_ms"]
    assert 0 <= lag["start"] and 0 <= lag["end"]
    assert result["counters_span_s"] == pytest.approx(
        result["seconds"] + (lag["end"] - lag["start"]) / 1000, abs=0.1)
    assert result["loads_per_s"] == pytest.approx(result["loads"] / result["counters_span_s"], rel=0.01)
    # The arena holds fewer than the twelve, so the window's loads evict and its acquires read blobs.
    assert result["evictions"] > 0
    assert result["blob_reads"] > 0
    assert 0 <= result["packed_reads"] <= result["blob_reads"]  # packed rows need 4 GB of free disk
    assert result["store_read_gb"] > 0
    assert result["arena_entry_mb"]["max"] <= result["arena_bytes"] / 1e6


def test_only_arena_full_refusals_and_every_pin_given_back(churn):
    result, _, _ = churn
    assert set(result["errors"]) <= KNOWN_CODES, result["errors"]
    assert result["unanswered_at_end"] == 0
    arena = result["arena_end"]
    assert arena["pins"] == 0 and arena["pinned_bytes"] == 0
    assert 0 < arena["used_bytes"] <= arena["capacity_bytes"]


def test_line_is_appended_and_nothing_is_left_running(churn):
    result, work, out = churn
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == result
    assert not alive(result["store_pid"])
    assert not Path("/dev/shm", result["arena_name"]).exists()
    assert not list(work.glob("run-*")), "the run's redis and blob folders are removed"
    assert Path(result["store_log"]).is_file()


@pytest.mark.parametrize("flag, value", [("--n", "0"), ("--in-flight", "0"), ("--seconds", "0"),
                                         ("--arena-gb", "-1"), ("--setting", "S3")])
def test_bad_numbers_are_refused_with_the_flag_named(flag, value, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--work-dir", str(tmp_path), flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing written before the arguments are checked"
