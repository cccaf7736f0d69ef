"""The workload generator draws what BENCHMARKS.md specifies: the statistics of large traces against their
closed forms, with tolerances several standard errors wide yet far narrower than any wrong parameter would
give (each comment says what a mistake would produce)."""
from __future__ import annotations

import numpy as np
import pytest

from bench.workload import TraceRequest, make_trace


def gaps(trace: list[TraceRequest]) -> np.ndarray:
    return np.diff([0.0] + [r.arrival_s for r in trace])


@pytest.mark.parametrize("cv", [1.0, 4.0])
def test_arrival_rate_and_burstiness(cv):
    # ~20000 gaps: the mean gap's standard error is cv/sqrt(n) (0.7% at cv=1, 2.8% at cv=4); the sample
    # cv's is a few percent at cv=4. A shape/scale swap (shape cv², scale 1/(cv² R)) would give cv 1/cv.
    trace = make_trace(10, 1.0, req_rate=100.0, cv=cv, duration_s=200.0, seed=3)
    g = gaps(trace)
    assert len(trace) > 15000
    assert 1.0 / g.mean() == pytest.approx(100.0, rel=0.03 * cv)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.03 * cv)
    assert all(0 < r.arrival_s < 200.0 for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert [r.index for r in trace] == list(range(len(trace)))


def test_bursty_arrivals_cluster():
    # The same mean rate, but at cv=4 requests come in clumps: some 1-second windows are empty and the
    # counts' variance is ~cv² times Poisson's (16x here).
    def counts(cv):
        t = np.array([r.arrival_s for r in make_trace(0, 1.0, 20.0, cv, 500.0, seed=1)])
        return np.bincount(t.astype(int), minlength=500)

    smooth, bursty = counts(1.0), counts(4.0)
    assert (smooth == 0).mean() < 0.01  # Poisson(20) is almost never 0
    assert (bursty == 0).mean() > 0.05
    assert 8 * smooth.var() < bursty.var() < 30 * smooth.var()


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_adapter_popularity_follows_the_power_law(alpha):
    # P(adapter < k) = (k/n)^alpha for floor(power(alpha) * n). With 40000 draws each empirical CDF
    # value is within 0.01 (4 standard errors at most 0.0025 each).
    n = 100
    trace = make_trace(n, alpha, req_rate=200.0, cv=1.0, duration_s=200.0, seed=5)
    a = np.array([r.adapter for r in trace])
    assert a.min() >= 0 and a.max() <= n - 1
    for k in (1, 5, 20, 50, 90):
        assert (a < k).mean() == pytest.approx((k / n) ** alpha, abs=0.01), k


def test_small_alpha_skews_and_alpha_one_is_uniform():
    n = 50
    skewed = np.bincount([r.adapter for r in make_trace(n, 0.1, 200.0, 1.0, 100.0, seed=2)], minlength=n)
    uniform = np.bincount([r.adapter for r in make_trace(n, 1.0, 200.0, 1.0, 100.0, seed=2)], minlength=n)
    assert skewed[0] / skewed.sum() > 0.6  # 0.02^0.1 = 0.676 of all requests on adapter 0
    assert skewed[0] > 100 * skewed[-1]
    # Uniform over 50 adapters with ~20000 requests: 400 each, binomial sd 20; every count within 25%.
    assert uniform.min() > 0.75 * uniform.mean() and uniform.max() < 1.25 * uniform.mean()
    # Chi-square with 49 degrees of freedom: mean 49, sd 10; 100 is beyond 5 sd.
    assert ((uniform - uniform.mean()) ** 2 / uniform.mean()).sum() < 100


def test_base_model_only_when_no_adapters():
    trace = make_trace(0, 1.0, 10.0, 1.0, 20.0, seed=0)
    assert trace and all(r.adapter is None for r in trace)


def test_lengths_uniform_in_their_ranges_and_independent():
    trace = make_trace(4, 1.0, 200.0, 1.0, 100.0, seed=9)
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    assert p.min() == 8 and p.max() == 511 and o.min() == 8 and o.max() == 511  # [8, 512): 512 never drawn
    # Uniform on 8..511: mean 259.5, sd 145.5; the mean's standard error over 20000 draws is ~1.
    assert p.mean() == pytest.approx(259.5, abs=5) and o.mean() == pytest.approx(259.5, abs=5)
    assert p.std() == pytest.approx(145.5, rel=0.03) and o.std() == pytest.approx(145.5, rel=0.03)
    assert abs(np.corrcoef(p, o)[0, 1]) < 0.03  # independent draws (the same stream twice would give 1)
    assert not np.array_equal(p, o)

    short = make_trace(4, 1.0, 50.0, 1.0, 20.0, seed=9, prompt_range=(3, 6), output_range=(2, 4))
    assert {r.prompt_len for r in short} == {3, 4, 5} and {r.output_len for r in short} == {2, 3}


def test_same_seed_same_trace_other_seed_other_trace():
    a = make_trace(100, 0.5, 5.0, 2.0, 60.0, seed=7)
    assert a == make_trace(100, 0.5, 5.0, 2.0, 60.0, seed=7)
    b = make_trace(100, 0.5, 5.0, 2.0, 60.0, seed=8)
    assert [r.arrival_s for r in a[:10]] != [r.arrival_s for r in b[:10]]
    assert [r.prompt_len for r in a[:50]] != [r.prompt_len for r in b[:50]]


def test_sweep_points_share_their_random_numbers():
    # Changing n keeps arrivals and lengths; doubling R halves every arrival time of the same draws.
    base = make_trace(100, 1.0, 4.0, 2.0, 100.0, seed=4)
    more = make_trace(1000, 1.0, 4.0, 2.0, 100.0, seed=4)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in base] == [(r.arrival_s, r.prompt_len, r.output_len) for r in more]
    assert [r.adapter for r in base] != [r.adapter for r in more]
    fast = make_trace(100, 1.0, 8.0, 2.0, 100.0, seed=4)
    half = [r for r in base if r.arrival_s < 50.0]
    assert [r.arrival_s / 2 for r in half] == pytest.approx([r.arrival_s for r in fast[:len(half)]], rel=1e-12)
    assert [r.adapter for r in half] == [r.adapter for r in fast[:len(half)]]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n_adapters=-1), "n_adapters"), (dict(n_adapters=2.5), "n_adapters"), (dict(alpha=0), "alpha"),
    (dict(req_rate=0), "req_rate"), (dict(cv=-1), "cv"), (dict(duration_s=float("inf")), "duration_s"),
    (dict(prompt_range=(0, 10)), "prompt_range"), (dict(output_range=(10, 10)), "output_range"),
    (dict(prompt_range="long"), "prompt_range"),
])
def test_bad_parameters_are_named(kwargs, needle):
    args = dict(n_adapters=5, alpha=1.0, req_rate=1.0, cv=1.0, duration_s=10.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=needle):
        make_trace(**args)
