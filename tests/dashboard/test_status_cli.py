"""`loraplex status` as a user runs it (a real process against a real stack): the summary states what the
server reports, the figures equal /metrics, auth and an unreachable server give clear errors."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from shared.ports import free_port
from tests.dashboard.conftest import ADMIN, REPO, TENANT, complete, metric_sum, settled_samples


def loraplex_status(url: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "status", "--url", url, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_summary_names_workers_adapters_and_totals_that_equal_metrics(stack):
    with stack.client() as c:
        for i in range(3):
            assert complete(c, "demo-001", i, max_tokens=4).status_code == 200
    m = settled_samples(stack)
    done = loraplex_status(stack.url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\x1b[" not in out  # no colour codes when the output is not a terminal
    assert re.search(r"model 'model'\s+READY", out)
    assert re.search(r"worker-0\s+healthy", out)
    totals = re.search(r"requests ([0-9,]+).*tokens ([0-9,]+) generated", out)
    assert int(totals.group(1).replace(",", "")) == metric_sum(m, "loraplex_requests_total")
    assert int(totals.group(2).replace(",", "")) == metric_sum(m, "loraplex_generation_tokens_total")
    pool = re.search(r"worker-0\s+healthy\s+\d+\s+\d+\s+\[[#:.]+\]\s+([0-9,]+)\s+([0-9,]+)\s+([0-9,]+)\s+([0-9,]+)", out)
    for value, kind in zip(pool.groups(), ("kv", "adapter", "free", "total")):
        assert int(value.replace(",", "")) == metric_sum(m, "loraplex_pool_slots", worker="worker-0", kind=kind)
    tiers = re.search(r"GPU pool (\d+)\s+host arena (\d+)\s+disk (\d+)", out)
    for value, tier in zip(tiers.groups(), ("gpu", "host", "disk")):
        assert int(value) == metric_sum(m, "loraplex_adapters_resident", tier=tier)
    assert re.search(r"on GPU .*demo-001 \(\d+ req\)", out)
    # A CPU worker replays no decode graphs: none of its step time is graphed. Its decode steps read the rows
    # of the adapters their requests named, as its counters say (here the one adapter of the three requests,
    # beside other tests' traffic on this shared stack).
    read = re.search(r"worker-0\s+healthy.*\s0%\s+([0-9.]+)\s*$", out, re.MULTILINE)
    decode_steps = sum(metric_sum(m, "loraplex_worker_steps_total", worker="worker-0", kind=k) for k in ("graph", "decode"))
    decode_adapters = sum(metric_sum(m, "loraplex_worker_step_adapters_total", worker="worker-0", kind=k)
                          for k in ("graph", "decode"))
    assert float(read.group(1)) == round(decode_adapters / decode_steps, 1) > 0


def test_json_is_the_status_document(stack):
    done = loraplex_status(stack.url, "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["object"] == "status" and status["ready"] is True
    assert [w["id"] for w in status["workers"]] == ["worker-0"]
    # Its steps since it started, by kind, as its counters on /metrics say (no graphs on the CPU).
    m = settled_samples(stack)
    steps = loraplex_status(stack.url, "--json")
    worker = json.loads(steps.stdout)["workers"][0]["steps"]
    assert set(worker) == {"graph", "decode", "prefill"} and worker["graph"]["steps"] == 0
    for kind, figures in worker.items():
        assert figures["steps"] == metric_sum(m, "loraplex_worker_steps_total", worker="worker-0", kind=kind)
        assert figures["tokens"] == metric_sum(m, "loraplex_worker_step_tokens_total", worker="worker-0", kind=kind)
        assert 0 <= figures["launch_seconds"] <= figures["seconds"]


def test_auth_errors_name_the_problem_and_the_admin_key_works(secured_stack):
    missing = loraplex_status(secured_stack.url)
    assert missing.returncode == 1 and "401" in missing.stderr and "missing API key" in missing.stderr
    tenant = loraplex_status(secured_stack.url, "--api-key", TENANT)
    assert tenant.returncode == 1 and "403" in tenant.stderr and "admin key" in tenant.stderr
    admin = loraplex_status(secured_stack.url, env={"LORAPLEX_API_KEY": ADMIN})
    assert admin.returncode == 0, admin.stderr
    assert "auth on" in admin.stdout and "READY" in admin.stdout


def test_an_unreachable_server_is_an_error_not_a_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    done = loraplex_status(url)
    assert done.returncode == 1
    assert f"cannot reach {url}" in done.stderr and "Traceback" not in done.stderr


def test_watch_redraws_until_interrupted(stack):
    # A shell runs background jobs with SIGINT ignored and children inherit that (Python then installs no
    # handler): give the command Ctrl-C's default, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "status", "--url", stack.url, "--watch", "0.5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.count("loraplex at ") >= 3 and "Traceback" not in err
