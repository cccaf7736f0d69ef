import pytest

from services.scheduler.early_abort import PrefillEstimator, hopeless
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def queue_of(*items):
    q = WaitingQueue()
    for rid, arrival, prompt, tenant in items:
        q.push(QueuedRequest(rid, "", tenant, prompt, 8, arrival))
    return q


def test_requests_that_cannot_meet_the_slo_are_found():
    est = PrefillEstimator(overhead_s=0.0, per_token_s=0.01)  # 100 tokens = 1 s of prefill
    q = queue_of(("old-long", 0.0, 300, "t"), ("old-short", 0.5, 10, "t"), ("new-long", 4.0, 300, "t"))
    for r in [q.get("old-long"), q.get("old-short"), q.get("new-long")]:
        est.note_prompt(r.prompt_tokens)
    # At t=4: old-long waited 4 s + 3 s prefill > 6; old-short 3.5 + 0.1 fits; new-long 0 + 3 fits.
    assert [r.request_id for r in hopeless(q, 4.0, 6.0, est)] == ["old-long"]
    # At t=6.5 old-short (6.0 + 0.1) is late too, new-long (2.5 + 3) still fits.
    assert [r.request_id for r in hopeless(q, 6.5, 6.0, est)] == ["old-long", "old-short"]


def test_disabled_slo_aborts_nothing():
    est = PrefillEstimator()
    q = queue_of(("r", 0.0, 10, "t"))
    assert hopeless(q, 1e9, 0.0, est) == []


def test_every_tenant_lane_is_checked_and_retries_are_exempt():
    est = PrefillEstimator(overhead_s=0.0, per_token_s=0.0)
    q = queue_of(("a-old", 0.0, 1, "a"), ("b-old", 1.0, 1, "b"), ("b-new", 9.0, 1, "b"))
    lost = QueuedRequest("lost", "", "a", 1, 8, 0.0)
    q.push_retry(lost)
    assert sorted(r.request_id for r in hopeless(q, 10.0, 6.0, est)) == ["a-old", "b-old"]


def test_estimator_follows_observed_first_tokens():
    est = PrefillEstimator(overhead_s=0.0, per_token_s=0.001, smoothing=0.5)
    est.observe(100, 1.0)  # 10 ms per token observed
    assert est.per_token_s == pytest.approx(0.0055)
    for _ in range(30):
        est.observe(100, 1.0)
    assert est.estimate(100) == pytest.approx(1.0, rel=1e-3)
    est.observe(0, 5.0)  # nothing to learn from an empty prompt
    assert est.estimate(100) == pytest.approx(1.0, rel=1e-3)
