"""Fixtures of the operator-experience tests: a real `loraplex up` stack (tests.e2e's Stack, services on one
intra-op thread as in tests.reliability), a second one with API keys, and headless Chromium driven by
Playwright (Debian's /usr/bin/chromium, never a downloaded browser). Helpers read /metrics the way a
scraper does, so the tests can hold the pages and the CLI to it."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from shared.probes import metric_samples, metric_sum  # noqa: F401  (metric_sum: for the tests here)

from tests.e2e.conftest import REPO  # noqa: F401  (the repository root, for subprocesses)
from tests.reliability.conftest import Stack

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
ADMIN = "dash-admin-5e1f0c9a7b3d2468"
TENANT = "dash-tenant-8c2e4a6f1b3d5709"
UPLOAD_CAP = 2_000_000


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Auth off, three demo adapters, a 2 MB upload cap."""
    root = tmp_path_factory.mktemp("dashboard-stack")
    s = Stack(root / "data", "--demo-adapters", "3", "--set", f"gateway.max_upload_bytes={UPLOAD_CAP}",
              "--set", f"store.max_upload_bytes={UPLOAD_CAP}", "--set", "scheduler.first_token_slo_s=0")
    try:
        yield s.start()
    finally:
        s.stop()
        s.kill_everything()


@pytest.fixture(scope="session")
def secured_stack(tmp_path_factory):
    """Auth on: one admin key, one tenant key."""
    root = tmp_path_factory.mktemp("dashboard-auth-stack")
    keys = root / "keys.json"
    keys.write_text(json.dumps({"admin_keys": [ADMIN], "tenants": {"acme": [TENANT]}}))
    s = Stack(root / "data", "--demo-adapters", "1", "--api-keys-file", str(keys),
              "--set", "scheduler.first_token_slo_s=0")
    try:
        yield s.start()
    finally:
        s.stop()
        s.kill_everything()


# Package scope: Playwright's sync API keeps an asyncio loop running in this thread while it is open, and
# later test packages call asyncio.run(), which refuses to start inside a running loop.
@pytest.fixture(scope="package")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: the test command installs Debian's chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh tab in a fresh context (empty sessionStorage); any script error on it fails the test."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.set_default_timeout(15_000)
    yield tab
    context.close()
    assert not errors, f"script errors on the page: {errors}"


# ---- reading /metrics -----------------------------------------------------------------------------------

def samples(stack: Stack) -> list:
    return metric_samples(stack.metrics())


def settled_samples(stack: Stack, timeout_s: float = 20.0) -> list:
    """/metrics once two reads a second apart agree (the workers' last statuses have reached the gateway)."""
    deadline = time.monotonic() + timeout_s
    last = samples(stack)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = samples(stack)
        if [(s.name, s.labels, s.value) for s in now] == [(s.name, s.labels, s.value) for s in last]:
            return now
        last = now
    raise AssertionError(f"/metrics still changing after {timeout_s}s")


# ---- traffic --------------------------------------------------------------------------------------------

def complete(client: httpx.Client, model: str, i: int, max_tokens: int = 12, stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": [1, 20 + i % 40, 77, 78, 79], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        return client.post("/v1/completions", json=body)
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.read()
        return r


class Traffic:
    """Requests from a few threads until stopped: every answer's status is kept."""

    def __init__(self, stack: Stack, models: list[str], threads: int = 4, max_tokens: int = 12,
                 headers: dict | None = None):
        self.stack, self.models, self.max_tokens, self.headers = stack, models, max_tokens, headers or {}
        self.stopping = threading.Event()
        self.statuses: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)]

    def _run(self, n: int) -> None:
        i = n
        with self.stack.client(headers=self.headers) as c:
            while not self.stopping.is_set():
                model = self.models[i % len(self.models)]
                r = complete(c, model, i, self.max_tokens, stream=i % 3 == 0)
                with self.lock:
                    self.statuses.append((model, r.status_code))
                i += len(self.threads)

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)
