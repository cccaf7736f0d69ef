"""Which decode graphs a worker captures before it reports ready, and in what order (the capture itself
needs a GPU: tests/gpu_worker/test_cuda_graphs.py)."""
import pytest

from services.gpu_worker.cuda_graphs import capture_plan
from shared.config import EngineConfig


def test_plan_covers_every_key_once_short_contexts_first_large_batches_first():
    plan = capture_plan((1, 2, 4), (16, 32), (512, 1024))
    assert len(plan) == len(set(plan)) == 3 * 3 * 2
    assert {ctx for _, _, ctx in plan[:9]} == {512}  # every graph of the shortest contexts comes first
    assert [size for size, _, _ in plan[:9]] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert [rank for _, rank, _ in plan[:3]] == [0, 16, 32]


@pytest.mark.parametrize("field,value", [("cuda_graph_warmup_s", -1.0), ("cuda_graph_max_context", -5)])
def test_graph_warm_up_settings_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
