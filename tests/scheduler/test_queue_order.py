"""Queue orders (scheduler.queue_order): fixed ones, used to compare admission policies against S-LoRA's switch,
and `deadline`, which keeps oldest first while the queue still drains within the first-token SLO."""
import time

import pytest

from services.scheduler.config import SchedulerConfig
from shared.wire import Ping, Pong
from tests.scheduler.peers import status, submit


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


@pytest.mark.parametrize("order,slo_s,first", [("auto", 60, "r4"), ("deadline", 60, "r1"), ("deadline", 3, "r4")])
def test_deadline_order_keeps_oldest_first_while_the_queue_drains_in_time(start, order, slo_s, first):
    sched = start(queue_order=order, first_token_slo_s=slo_s)
    gw = sched.gateway()
    wk = sched.worker("w0", max_running=1)
    sched.wait_workers(gw, 1)
    gw.send(submit("r0"))
    assert wk.assigned(1) == ["r0"]
    for i in range(1, 5):
        gw.send(submit(f"r{i}"))
    gw.send(Ping(call_id="queued"))
    assert gw.recv(Pong).queue_depth == 4
    # Past the end of the arrivals' scheduling period (0.5 s): five arrivals against one admission is
    # overload, and S-LoRA's switch serves newest first. One admission in the period is ~0.6 a second:
    # the four queued drain in ~7 s, in time for a 60 s SLO but not a 3 s one.
    time.sleep(0.6)
    wk.send(status("w0", step=1, finished=("r0",), max_running=1))
    assert wk.assigned(1) == [first]
    if slo_s == 60:  # the order it chose is reported (three queued still drain in time for `deadline`)
        gw.send(Ping(call_id="order"))
        pong = gw.recv(Pong)
        assert pong.newest_first == (order == "auto")
        # No first token seen yet: early abort's bar is the configured estimate for the longest prompt (3 tokens).
        assert pong.prefill_estimate_s == pytest.approx(0.02 + 3 * 1e-4)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="queue_order"):
        SchedulerConfig(queue_order="random")


def test_deadline_order_needs_a_first_token_slo():
    with pytest.raises(ValueError, match="first_token_slo_s"):
        SchedulerConfig(queue_order="deadline", first_token_slo_s=0)
