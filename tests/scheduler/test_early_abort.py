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


def test_estimator_starts_from_its_configured_terms_and_follows_observed_first_tokens():
    est = PrefillEstimator(overhead_s=0.5, per_token_s=0.001)
    assert est.estimate(100) == pytest.approx(0.6)
    est.observe(100, 1.0)
    # One prompt length seen: the level follows it, the slope is still the configured one.
    assert est.estimate(100) == pytest.approx(1.0)
    assert est.estimate(300) == pytest.approx(1.2)
    for _ in range(200):
        est.observe(100, 2.0)
    assert est.estimate(100) == pytest.approx(2.0, rel=1e-3)
    est.observe(0, 50.0)  # nothing to learn from an empty prompt
    est.observe(100, -1.0)  # nor from a clock that went backwards
    assert est.estimate(100) == pytest.approx(2.0, rel=1e-3)


def test_estimator_learns_a_cost_that_grows_with_the_prompt():
    est = PrefillEstimator(overhead_s=0.0, per_token_s=0.0)
    for i in range(400):
        n = 8 + (i * 37) % 504
        est.observe(n, 0.05 + 0.002 * n)
    assert est.per_token_s == pytest.approx(0.002, rel=1e-6)
    assert est.estimate(500) == pytest.approx(1.05, rel=1e-6)
    assert est.estimate(10) == pytest.approx(0.07, rel=1e-6)


def test_a_wait_every_prompt_shares_is_not_charged_to_long_prompts():
    """Assignment to first token is mostly a wait for the batch and its step, whatever the prompt's length:
    1 s +- 0.5 s here, prompts of 8..511 tokens. A long prompt's estimate stays near that 1 s (seconds / n per
    sample would make short prompts read as ~0.1 s a token and a 511-token one swing from 2 to 8 s), so a
    request that has just arrived is never hopeless."""
    est = PrefillEstimator()
    estimates = []
    for i in range(2000):
        n = 8 + (i * 97) % 504
        wait = 0.5 + (i * 7919 % 1000) / 1000  # spread over [0.5, 1.5) independently of n
        est.observe(n, wait + 5e-5 * n)
        est.note_prompt(n)
        if i >= 100:
            estimates.append(est.estimate(511))
    assert max(estimates) < 1.6 and min(estimates) > 0.6
    q = queue_of(("old", 3.0, 8, "t"), ("fresh-long", 10.0, 511, "t"))
    assert [r.request_id for r in hopeless(q, 10.0, 6.0, est)] == ["old"]
