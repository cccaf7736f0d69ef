"""The unified pool's size when num_slots is 0: the free GPU memory less worker.pool_headroom_gb, at most
worker.pool_memory_fraction of it. What is left holds the decode graphs and a step's activations, so a value
outside its range is refused by name."""
from __future__ import annotations

import pytest

from services.gpu_worker.pool import UnifiedPool
from services.gpu_worker.worker_config import parse_args
from shared.config import EngineConfig


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2, True, "0.9"])
def test_a_fraction_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="pool_memory_fraction must be a number between 0 and 1"):
        EngineConfig(pool_memory_fraction=value)


def test_a_fraction_inside_is_kept():
    assert EngineConfig(pool_memory_fraction=0.92).pool_memory_fraction == 0.92
    assert EngineConfig().pool_memory_fraction == 0.94


def test_the_worker_command_line_refuses_it_before_starting(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--pool-memory-fraction", "1.2"])
    assert "pool_memory_fraction must be a number between 0 and 1" in capsys.readouterr().err


GiB = 2**30


def test_the_pool_leaves_its_headroom_on_a_small_card_and_its_share_on_a_large_one():
    # An 80 GB card's ~64 GiB free after Llama-2-7B: 6 GiB left (0.906 of it); a 141 GB card's ~125.6 GiB:
    # the 0.94 share binds first (7.5 GiB left).
    assert UnifiedPool.bytes_for_pool(64 * GiB, 0.94, 6.0) == 58 * GiB
    assert UnifiedPool.bytes_for_pool(int(125.6 * GiB), 0.94, 6.0) == int(int(125.6 * GiB) * 0.94)
    # No headroom: the share alone, as before the headroom was counted.
    assert UnifiedPool.bytes_for_pool(64 * GiB, 0.85, 0.0) == int(64 * GiB * 0.85)


def test_a_card_with_no_more_than_the_headroom_free_is_refused_naming_the_settings():
    with pytest.raises(ValueError, match="pool_headroom_gb or set num_slots"):
        UnifiedPool.bytes_for_pool(5 * GiB, 0.94, 6.0)


@pytest.mark.parametrize("value", [-1, True, "6"])
def test_a_negative_or_non_numeric_headroom_is_refused(value):
    with pytest.raises(ValueError, match="pool_headroom_gb must be a number of GiB >= 0"):
        EngineConfig(pool_headroom_gb=value)
