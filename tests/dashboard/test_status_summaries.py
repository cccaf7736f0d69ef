"""The latency summaries of /v1/status: percentiles interpolated inside histogram buckets the way
Prometheus' histogram_quantile does, over a window taken as the difference of two readings."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.gateway.status import read_histogram


def histogram(values: list[float]) -> Histogram:
    h = Histogram("t", "test", buckets=(0.01, 0.1, 1.0), registry=CollectorRegistry())
    for v in values:
        h.observe(v)
    return h


def test_percentiles_interpolate_inside_the_bucket_that_holds_them():
    h = histogram([0.005] * 10 + [0.05] * 80 + [0.5] * 10)
    reading = read_histogram(h)
    assert reading.count == 100 and reading.total == pytest.approx(0.05 + 4.0 + 5.0)
    # rank 50 of 100: the 40th of the 80 observations in (0.01, 0.1]
    assert reading.quantile(0.5) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert reading.quantile(0.05) == pytest.approx(0.01 * 5 / 10)
    assert reading.quantile(0.99) == pytest.approx(0.1 + 0.9 * 9 / 10)
    summary = reading.summary()
    assert summary["count"] == 100 and summary["mean_s"] == pytest.approx(0.0905)


def test_above_the_last_bucket_the_answer_is_its_bound_and_an_empty_window_has_none():
    reading = read_histogram(histogram([5.0, 7.0]))
    assert reading.quantile(0.5) == 1.0
    assert reading.minus(reading).quantile(0.5) is None
    assert reading.minus(reading).summary()["mean_s"] is None


def test_a_window_is_the_difference_of_two_readings():
    h = histogram([0.5] * 50)
    earlier = read_histogram(h)
    for _ in range(20):
        h.observe(0.005)
    window = read_histogram(h).minus(earlier)
    assert window.count == 20 and window.total == pytest.approx(0.1)
    assert window.quantile(0.9) == pytest.approx(0.01 * 0.9)  # the older slow observations are outside it
