"""The scheduler process over real ZeroMQ sockets, with the test playing a gateway and workers."""
import signal
import time

import numpy as np
import pytest

from services.scheduler.config import SchedulerConfig
from shared.wire import (
    AbortRequest, Assign, Ping, Pong, PrefetchHint, RequestRejected, TokenBatch, TokenOutput, WorkerAbort,
    WorkerStatus,
)
from tests.scheduler.peers import status, submit


def out(rid, ids, finished=False):
    return TokenOutput(request_id=rid, token_ids=np.array(ids, dtype=np.int32), finished=finished,
                       finish_reason="length" if finished else None, prompt_tokens=3, completion_tokens=len(ids))


def test_request_flows_gateway_to_worker_and_tokens_back(start):
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0")
    gw.send(submit("r1", adapter="ad@1"))
    assign = wk.recv(Assign)
    assert [r.request_id for r in assign.requests] == ["r1"]
    assert assign.requests[0].adapter == "ad@1" and list(assign.requests[0].prompt_ids) == [1, 2, 3]
    wk.send(TokenBatch(worker_id="w0", outputs=[out("r1", [7])]))
    wk.send(TokenBatch(worker_id="w0", outputs=[out("r1", [8, 9], finished=True)]))
    first, last = gw.recv(TokenBatch), gw.recv(TokenBatch)
    assert list(first.outputs[0].token_ids) == [7]
    assert list(last.outputs[0].token_ids) == [8, 9] and last.outputs[0].finished


def test_pull_model_respects_reported_capacity(start):
    sched = start()
    gw = sched.gateway()
    for i in range(3):
        gw.send(submit(f"r{i}"))
    wk = sched.worker("w0", max_running=2)
    assert wk.assigned(2) == ["r0", "r1"]
    assert wk.quiet(Assign)
    # Finishing one frees a place; the worker's next status pulls the third.
    wk.send(TokenBatch(worker_id="w0", outputs=[out("r0", [5], finished=True)]))
    wk.send(status("w0", step=1, max_running=2, running=1))
    assert [r.request_id for r in wk.recv(Assign).requests] == ["r2"]


def test_slots_of_unused_adapters_count_as_room_for_prompts(start):
    # A pool full of adapters no request uses is not full: the worker evicts them for KV on demand.
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0", max_running=4)
    gw.send(submit("r0"))
    assert wk.assigned(1) == ["r0"]
    wk.send(status("w0", step=1, max_running=4, running=1, free_slots=2))
    gw.send(submit("r1", prompt=(1, 2, 3, 4, 5, 6)))
    assert wk.quiet(Assign)  # 2 free slots cannot take a 6-token prompt
    wk.send(status("w0", step=2, max_running=4, running=1, free_slots=2, evictable_slots=500))
    assert [r.request_id for r in wk.recv(Assign).requests] == ["r1"]


def test_a_worker_admitting_in_rounds_gets_its_backlog_on_top_of_its_batch(start):
    sched = start()
    gw = sched.gateway()
    for i in range(9):
        gw.send(submit(f"r{i}"))
    # A batch of 4 that admits 2 at a time once 2 places are free: 4 to run and 2 to wait for the next round.
    wk = sched.worker("w0", max_running=4, backlog=2)
    assert wk.assigned(6) == [f"r{i}" for i in range(6)]
    assert wk.quiet(Assign)
    wk.send(status("w0", step=1, max_running=4, backlog=2, running=4, waiting=2))
    assert wk.quiet(Assign)
    # Each request that ends frees one place of batch + backlog, whatever waits on the worker (those may
    # wait for their round or for an adapter on its way): the worker never holds more than 6.
    for i, rid in enumerate(["r0", "r1"]):
        wk.send(TokenBatch(worker_id="w0", outputs=[out(rid, [5], finished=True)]))
        assert len(wk.assigned(1)) == 1
        assert wk.quiet(Assign)
        wk.send(status("w0", step=2 + i, max_running=4, backlog=2, running=3, waiting=3))
        assert wk.quiet(Assign)


def test_worker_with_backlog_gets_nothing_more(start):
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0", waiting=3)
    gw.send(submit("r1"))
    assert wk.quiet(Assign)
    wk.send(status("w0", step=1, waiting=0))
    assert [r.request_id for r in wk.recv(Assign).requests] == ["r1"]


def test_full_queue_is_rejected_with_429_and_retry_after(start):
    sched = start(max_queue=2)
    gw = sched.gateway()
    for i in range(3):
        gw.send(submit(f"r{i}"))
    rejected = gw.recv(RequestRejected)
    assert (rejected.request_id, rejected.status, rejected.code) == ("r2", 429, "queue_full")
    assert rejected.retry_after >= 1
    gw.send(Ping(call_id="p"))
    assert gw.recv(Pong).queue_depth == 2


def test_tenant_bound_rejects_only_that_tenant(start):
    sched = start(max_queue_per_tenant=1)
    gw = sched.gateway()
    gw.send(submit("a1", tenant="a"))
    gw.send(submit("a2", tenant="a"))
    gw.send(submit("b1", tenant="b"))
    rejected = gw.recv(RequestRejected)
    assert (rejected.request_id, rejected.status, rejected.code) == ("a2", 429, "tenant_queue_full")
    assert gw.quiet(RequestRejected)


def test_duplicate_request_id_is_refused(start):
    sched = start()
    gw = sched.gateway()
    gw.send(submit("same"))
    gw.send(submit("same"))
    rejected = gw.recv(RequestRejected)
    assert (rejected.status, rejected.code) == (409, "duplicate_request_id")


def test_abort_of_queued_and_running_requests(start):
    sched = start()
    gw = sched.gateway()
    gw.send(submit("queued"))
    gw.send(AbortRequest(request_id="queued"))
    gw.send(Ping(call_id="sync"))
    assert gw.recv(Pong).queue_depth == 0
    wk = sched.worker("w0")
    gw.send(submit("running"))
    wk.recv(Assign)
    gw.send(AbortRequest(request_id="running"))
    assert wk.recv(WorkerAbort).request_ids == ["running"]
    # Outputs the worker produced before it saw the abort are not forwarded.
    wk.send(TokenBatch(worker_id="w0", outputs=[out("running", [1], finished=True)]))
    assert gw.quiet(TokenBatch)


def test_early_abort_of_requests_that_cannot_meet_the_slo(start):
    sched = start(first_token_slo_s=0.5)
    gw = sched.gateway()
    t0 = time.monotonic()
    gw.send(submit("late"))  # no worker: it can only wait
    rejected = gw.recv(RequestRejected, timeout=5)
    assert (rejected.request_id, rejected.status, rejected.code) == ("late", 503, "slo_unreachable")
    assert 0.4 < time.monotonic() - t0 < 3


def test_lost_worker_requeues_silent_requests_and_fails_streaming_ones(start):
    sched = start()
    gw = sched.gateway()
    w0 = sched.worker("w0")
    gw.send(submit("silent"))
    gw.send(submit("streaming"))
    assert sorted(w0.assigned(2)) == ["silent", "streaming"]
    w0.send(TokenBatch(worker_id="w0", outputs=[out("streaming", [4])]))
    assert list(gw.recv(TokenBatch).outputs[0].token_ids) == [4]
    w0.close()  # the connection drops as when the process is killed
    failed = gw.recv(TokenBatch, timeout=3)
    end = failed.outputs[0]
    assert (end.request_id, end.finished, end.finish_reason) == ("streaming", True, "error")
    assert "w0" in end.error
    w1 = sched.worker("w1")
    assert [r.request_id for r in w1.recv(Assign).requests] == ["silent"]


def test_restarted_worker_is_detected_by_its_new_socket(start):
    sched = start()
    gw = sched.gateway()
    old = sched.worker("w0")
    gw.send(submit("r1"))
    old.recv(Assign)
    new = sched.worker("w0")  # same id, new connection, old one still open
    assert [r.request_id for r in new.recv(Assign).requests] == ["r1"]


def test_silent_worker_is_declared_dead_after_heartbeat_timeout(start):
    sched = start(heartbeat_timeout_s=0.5, max_retries=0)
    gw = sched.gateway()
    wk = sched.worker("w0")
    gw.send(submit("r1"))
    wk.recv(Assign)
    rejected = gw.recv(RequestRejected, timeout=3)  # no retries allowed: a clean 503
    assert (rejected.request_id, rejected.status, rejected.code) == ("r1", 503, "worker_failed")
    # If it was only slow, it must not go on computing a request that was answered already.
    assert wk.recv(WorkerAbort).request_ids == ["r1"]


def test_affinity_routes_to_the_worker_holding_the_adapter(start):
    sched = start()
    gw = sched.gateway()
    w0 = sched.worker("w0", max_running=4)
    w1 = sched.worker("w1", max_running=4, resident=["b@1"])
    sched.wait_workers(gw, 2)
    gw.send(submit("rb", adapter="b@1"))
    assert [r.request_id for r in w1.recv(Assign).requests] == ["rb"]
    assert w0.quiet(Assign, wait=0.2)


def test_prefetch_hints_name_adapters_at_the_queue_head(start):
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0", max_running=1)
    for rid, adapter in [("r0", "a@1"), ("r1", "b@1"), ("r2", None), ("r3", "c@1")]:
        gw.send(submit(rid, adapter=adapter))
    assert [r.request_id for r in wk.recv(Assign).requests] == ["r0"]
    hint = wk.recv(PrefetchHint)
    while hint.adapters != ["b@1", "c@1"]:  # hints follow the queue as it fills
        hint = wk.recv(PrefetchHint)


def test_ping_forwards_worker_statuses_then_pong(start):
    sched = start()
    gw = sched.gateway()
    sched.worker("w0", free_slots=123)
    # Until the scheduler has the worker's status (a fixed sleep once lost that race on a loaded machine);
    # what those pings forwarded is dropped, so the status read below is this ping's.
    sched.wait_workers(gw, 1)
    gw.backlog.clear()
    gw.send(Ping(call_id="m"))
    forwarded = gw.recv(WorkerStatus)
    assert (forwarded.worker_id, forwarded.free_slots) == ("w0", 123)
    pong = gw.recv(Pong)
    assert (pong.service, pong.call_id, pong.workers_ready) == ("scheduler", "m", 1)


def test_gateway_disconnect_aborts_its_requests(start):
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0")
    gw.send(submit("orphan"))
    wk.recv(Assign)
    gw.close()
    assert wk.recv(WorkerAbort, timeout=3).request_ids == ["orphan"]


def test_sigterm_drains_then_exits(start):
    sched = start()
    gw = sched.gateway()
    wk = sched.worker("w0")
    gw.send(submit("r1"))
    wk.recv(Assign)
    sched.proc.send_signal(signal.SIGTERM)
    # Until the scheduler says it drains (its Pong turns not ready): a fixed sleep races a loaded machine.
    deadline = time.monotonic() + 5
    while True:
        gw.send(Ping(call_id="drain"))
        if not gw.recv(Pong).ready:
            break
        assert time.monotonic() < deadline, "the scheduler never started draining"
        time.sleep(0.02)
    gw.send(submit("r2"))
    rejected = gw.recv(RequestRejected)
    assert (rejected.request_id, rejected.status, rejected.code) == ("r2", 503, "shutting_down")
    assert sched.proc.poll() is None  # r1 still running
    wk.send(TokenBatch(worker_id="w0", outputs=[out("r1", [3], finished=True)]))
    assert gw.recv(TokenBatch).outputs[0].finished
    assert sched.proc.wait(timeout=5) == 0
    # The signal handler only marks the drain; the loop logs it (a handler that logs can deadlock on the
    # log's lock when the signal lands inside a log write).
    assert "draining" in sched.log_path.read_text()


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown SchedulerConfig field"):
        SchedulerConfig.from_dict({"max_queue": 3, "no_such": 1})
    with pytest.raises(ValueError, match="max_queue must be positive"):
        SchedulerConfig(max_queue=0)
