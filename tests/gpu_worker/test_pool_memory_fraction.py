"""worker.pool_memory_fraction: the share of free GPU memory the unified pool takes when num_slots is 0. What
is left holds the decode graphs and a step's activations, so a value outside (0, 1) is refused by name."""
from __future__ import annotations

import pytest

from services.gpu_worker.worker_config import parse_args
from shared.config import EngineConfig


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2, True, "0.9"])
def test_a_fraction_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="pool_memory_fraction must be a number between 0 and 1"):
        EngineConfig(pool_memory_fraction=value)


def test_a_fraction_inside_is_kept():
    assert EngineConfig(pool_memory_fraction=0.92).pool_memory_fraction == 0.92
    assert EngineConfig().pool_memory_fraction == 0.85


def test_the_worker_command_line_refuses_it_before_starting(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--pool-memory-fraction", "1.2"])
    assert "pool_memory_fraction must be a number between 0 and 1" in capsys.readouterr().err
