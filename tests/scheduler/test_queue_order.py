"""A fixed queue order (scheduler.queue_order), used to compare admission policies against S-LoRA's switch."""
import pytest

from services.scheduler.config import SchedulerConfig
from shared.wire import Ping, Pong
from tests.scheduler.peers import submit


def queue_then_take(sched, n: int) -> list[str]:
    gw = sched.gateway()
    for i in range(n):
        gw.send(submit(f"r{i}"))
    gw.send(Ping(call_id="queued"))
    assert gw.recv(Pong).queue_depth == n
    # The worker connects after all are queued and takes one at a time: the order it gets them is the policy's.
    wk = sched.worker("w0", max_running=1)
    return wk.assigned(1)


@pytest.mark.parametrize("order,first", [("fcfs", "r0"), ("lcfs", "r4")])
def test_fixed_order_serves_oldest_or_newest_first(start, order, first):
    assert queue_then_take(start(queue_order=order, first_token_slo_s=0), 5) == [first]


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="queue_order"):
        SchedulerConfig(queue_order="random")
