"""The dashboard in headless Chromium against a real stack: under traffic its figures and charts move, and
once the stack is idle every figure on the page equals the one /metrics reports."""
from __future__ import annotations

import re
import time

from tests.dashboard.conftest import Traffic, metric_sum, samples

TRAFFIC_MODEL = "demo-002"  # no other test sends requests to it: its request count is this test's alone


def number(page, selector: str) -> float:
    """The leading figure of an element as the page shows it ("1,234", "2 / 3", "16 req"), as a number."""
    found = re.match(r"[0-9][0-9,]*(\.[0-9]+)?", page.locator(selector).inner_text().strip())
    return float(found.group(0).replace(",", "")) if found else float("nan")


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last is True:
            return
        time.sleep(0.25)
    raise AssertionError(f"{what} within {timeout_s}s; last mismatch: {last}")


# The charts' plot area ends this many CSS pixels above the canvas bottom (charts.js PAD.bottom): the zero line.
CHART_PAD_BOTTOM = 22


def newest_rate_height(page, canvas_id: str) -> int:
    """How far above the zero line the chart line's newest point (its rightmost end) is, in canvas pixels
    (0: no line, or the newest rate is zero). The chart covers minutes, so earlier tests' traffic may still
    be on it; its newest point is this moment's rate."""
    return page.evaluate("""([id, padBottom]) => {
        const canvas = document.getElementById(id), ctx = canvas.getContext('2d');
        const { width, height } = canvas, data = ctx.getImageData(0, 0, width, height).data;
        const zero = Math.round(height - padBottom * height / canvas.clientHeight);
        for (let x = width - 1; x >= 0; x--) {
            for (let y = 0; y < height; y++) {
                const i = 4 * (y * width + x);
                // the series colours: saturated, unlike the grey grid and labels
                if (Math.max(data[i], data[i + 1], data[i + 2]) - Math.min(data[i], data[i + 1], data[i + 2]) > 90 && data[i + 3] > 200) {
                    return Math.max(0, zero - y);
                }
            }
        }
        return 0;
    }""", [canvas_id, CHART_PAD_BOTTOM])


def page_matches_metrics(page, stack, sent_to_model: int):
    """True, or the first figure on the page that differs from /metrics."""
    m = samples(stack)
    checks = {
        "#total-requests": metric_sum(m, "loraplex_requests_total"),
        "#total-generation-tokens": metric_sum(m, "loraplex_generation_tokens_total"),
        "#total-prompt-tokens": metric_sum(m, "loraplex_prompt_tokens_total"),
        "#total-ttft-count": metric_sum(m, "loraplex_time_to_first_token_seconds_count"),
        "#total-rejections": metric_sum(m, "loraplex_rejections_total"),
        "#queue-depth": metric_sum(m, "loraplex_queue_depth"),
        "#in-flight": metric_sum(m, "loraplex_gateway_in_flight"),
        "#tile-workers": metric_sum(m, "loraplex_workers_ready"),
    }
    for tier in ("gpu", "host", "disk"):
        checks[f"#tier-{tier}-count"] = metric_sum(m, "loraplex_adapters_resident", tier=tier)
    for kind in ("kv", "adapter", "free", "total"):
        checks[f"#workers tr[data-worker='worker-0'] [data-field='{kind}']"] = metric_sum(
            m, "loraplex_pool_slots", worker="worker-0", kind=kind)
    checks[f"#tier-gpu-list li[data-adapter^='{TRAFFIC_MODEL}@'] [data-field='requests']"] = sent_to_model
    for selector, expected in checks.items():
        shown = number(page, selector)
        if shown != expected:
            return f"{selector}: page {shown}, /metrics {expected}"
    return True


def test_dashboard_follows_traffic_and_matches_metrics(stack, page):
    page.goto(f"{stack.url}/dashboard")
    page.wait_for_selector("#total-requests[data-value]")
    assert page.locator("#ready-text").inner_text() == "ready"
    assert page.locator("#workers tr[data-worker='worker-0'] [data-field='health']").inner_text() == "healthy"
    before = number(page, "#total-requests")

    with Traffic(stack, [TRAFFIC_MODEL, "model", "demo-000"], threads=4) as traffic:
        wait_until(lambda: number(page, "#total-requests") >= before + 8 or "no change yet", 30,
                   "the request total on the page grew with the traffic")
        wait_until(lambda: number(page, "#tile-rps") > 0 or "rate still 0", 15, "the request rate rose")
        wait_until(lambda: newest_rate_height(page, "chart-requests") > 10 or "flat", 15,
                   "the request-rate chart drew the traffic")
        page.wait_for_selector(f"#tier-gpu-list li[data-adapter^='{TRAFFIC_MODEL}@']")
        with stack.client() as c:
            assert c.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "x"}).status_code == 404
    assert traffic.statuses and all(status == 200 for _, status in traffic.statuses), traffic.statuses
    sent = sum(model == TRAFFIC_MODEL for model, _ in traffic.statuses)

    # Idle now: every figure settles on the value /metrics gives (the page polls once a second).
    wait_until(lambda: page_matches_metrics(page, stack, sent), 20, "the page's figures equal /metrics")
    assert number(page, "#tile-ttft") > 0 and number(page, "#total-rejections") >= 1
    assert "404" in page.locator("#total-by-status").inner_text()
    assert page.locator("#pool-charts [data-worker='worker-0'] canvas").count() == 1


def test_status_endpoint_totals_equal_metrics(stack):
    """The JSON the page draws from, checked field by field against /metrics at an idle moment."""
    with stack.client() as c:
        # On a stack just started, the first points of the series may predate the worker's first report.
        def pool_in_series():
            series = c.get("/v1/status", params={"history": 30}).json()["series"]
            return bool(series) and "worker-0" in series[-1]["pool"] or f"{len(series)} points, none with it"

        wait_until(pool_in_series, 10, "the worker's pool in the series")
        status = c.get("/v1/status", params={"history": 30}).json()
    m = samples(stack)
    assert status["requests"]["total"] == metric_sum(m, "loraplex_requests_total")
    assert status["requests"]["generation_tokens"] == metric_sum(m, "loraplex_generation_tokens_total")
    assert status["latency"]["ttft"]["total_count"] == metric_sum(m, "loraplex_time_to_first_token_seconds_count")
    assert abs(status["latency"]["ttft"]["total_sum_s"] - metric_sum(m, "loraplex_time_to_first_token_seconds_sum")) < 1e-9
    worker = {w["id"]: w for w in status["workers"]}["worker-0"]
    for kind in ("kv", "adapter", "free", "total"):
        assert worker["slots"][kind] == metric_sum(m, "loraplex_pool_slots", worker="worker-0", kind=kind)
    for kind, steps in worker["steps"].items():
        assert steps["ahead"] == metric_sum(m, "loraplex_worker_steps_ahead_total", worker="worker-0", kind=kind)
        assert steps["adapters"] == metric_sum(m, "loraplex_worker_step_adapters_total", worker="worker-0", kind=kind)
        assert steps["adapter_bytes"] == metric_sum(m, "loraplex_worker_step_adapter_bytes_total", worker="worker-0",
                                                    kind=kind)
    assert set(worker["steps_held_back"]) == {"prompt", "batch", "round", "slots"}
    for reason, n in worker["steps_held_back"].items():
        assert n == metric_sum(m, "loraplex_worker_steps_held_back_total", worker="worker-0", reason=reason)
    assert status["adapters"]["tiers"]["disk"] == status["adapters"]["registered"] >= 3
    # One point a second, oldest first, each with the pool of every worker that had reported.
    times = [p["t"] for p in status["series"]]
    assert 1 <= len(times) <= 30
    assert all(0.5 < later - earlier < 2.5 for earlier, later in zip(times, times[1:])), times
    assert "worker-0" in status["series"][-1]["pool"]
    with stack.client() as c:
        refused = c.get("/v1/status", params={"history": "-1"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "history"
