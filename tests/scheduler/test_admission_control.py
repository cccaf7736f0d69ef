import pytest

from services.scheduler.admission import QUEUE_FULL, TENANT_QUEUE_FULL, Admission
from services.scheduler.rates import RateMonitor
from services.scheduler.waiting_queue import QueuedRequest, WaitingQueue


def fill(q, tenant, n, start=0):
    for i in range(n):
        q.push(QueuedRequest(f"{tenant}{start + i}", "", tenant, 4, 4, 0.0))


def test_full_queue_is_rejected_with_retry_after_from_service_rate():
    q = WaitingQueue()
    fill(q, "a", 8)
    adm = Admission(max_queue=8)
    rejection = adm.check(q, "b", service_rate=2.0)
    assert rejection.reason == QUEUE_FULL
    assert rejection.retry_after_s == 4  # 8 waiting, 2 leave per second
    q.remove("a0")
    assert adm.check(q, "b", service_rate=2.0) is None


def test_tenant_bound_rejects_only_that_tenant():
    q = WaitingQueue()
    fill(q, "noisy", 3)
    adm = Admission(max_queue=100, max_queue_per_tenant=3)
    assert adm.check(q, "noisy", 1.0).reason == TENANT_QUEUE_FULL
    assert adm.check(q, "quiet", 1.0) is None


def test_retry_after_is_clamped():
    adm = Admission(max_queue=1, min_retry_s=1, max_retry_s=30)
    assert adm.retry_after(1000, 1.0) == 30
    assert adm.retry_after(1, 100.0) == 1
    assert adm.retry_after(5, 0.0) == 30  # nothing is leaving the queue: come back late


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_queue"):
        Admission(max_queue=0)
    with pytest.raises(ValueError, match="max_queue_per_tenant"):
        Admission(max_queue=1, max_queue_per_tenant=-1)


def test_rate_monitor_sees_overload_when_arrivals_outpace_admissions():
    rates = RateMonitor(period_s=1.0, smoothing=0.5, now=0.0)
    for t in range(10):
        rates.record_arrival(t + 0.1, n=4)
        rates.record_admission(t + 0.2, n=4)
    assert not rates.overloaded(10.5)
    assert rates.service_rate(10.5) == pytest.approx(4.0, rel=0.01)
    for t in range(10, 14):
        rates.record_arrival(t + 0.1, n=8)
        rates.record_admission(t + 0.2, n=2)
    assert rates.overloaded(14.5)
    # Once arrivals stop and the backlog drains, admissions overtake arrivals again.
    for t in range(14, 18):
        rates.record_admission(t + 0.2, n=6)
    assert not rates.overloaded(18.5)


def test_rate_monitor_decays_over_idle_gaps():
    rates = RateMonitor(period_s=1.0, smoothing=0.5, now=0.0)
    rates.record_arrival(0.5, n=10)
    assert rates.overloaded(1.5)  # ten arrived, none admitted
    assert rates.arrivals_avg == pytest.approx(5.0)
    rates.overloaded(100.0)
    assert rates.arrivals_avg < 1e-20
