"""`loraplex adapters add` as a user runs it on many folders: a progress bar to the last folder, the good
adapters all registered even when some folders are bad, and each failure named by its file and the
server's reason, with the exit status telling which kind of failure happened."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from shared.make_adapters import make_adapters
from tests.dashboard.conftest import REPO

BULK = 200


def adapters_cli(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "adapters", "--url", stack.url, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def registered(stack) -> set[str]:
    with stack.client() as c:
        return {card["name"] for card in c.get("/v1/adapters").json()["data"]}


def test_hundreds_of_folders_with_a_progress_bar(stack, tmp_path):
    folders = make_adapters(tmp_path, stack.data_dir / "model", BULK, ranks=[1, 2], targets=["q_proj"], seed=6161,
                            prefix="bulk")
    done = adapters_cli(stack, "add", "--jobs", "8", *map(str, folders))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("added") == BULK
    assert f"{BULK}/{BULK}" in done.stderr  # the bar reached the last folder
    assert f"{BULK} added, 0 unchanged, 0 failed of {BULK}" in done.stderr
    assert {f.name for f in folders} <= registered(stack)


def test_bad_folders_are_named_with_the_file_and_the_reason_and_the_rest_are_added(stack, tmp_path):
    model_dir = stack.data_dir / "model"
    good = make_adapters(tmp_path / "good", model_dir, 4, ranks=[4], seed=6262, prefix="mixed-good")
    bad = make_adapters(tmp_path / "bad", model_dir, 3, ranks=[4], seed=6363, prefix="mixed-bad")
    truncated, wrong_rank, no_config = bad
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    config = json.loads((wrong_rank / "adapter_config.json").read_text())
    config["r"] = 3
    (wrong_rank / "adapter_config.json").write_text(json.dumps(config))
    (no_config / "adapter_config.json").unlink()

    done = adapters_cli(stack, "add", *map(str, good), str(truncated), str(wrong_rank), str(no_config))
    assert done.returncode == 2, done.stderr  # a PATH was not an adapter folder
    err = done.stderr
    assert re.search(rf"failed +mixed-bad-000: {re.escape(str(weights))}: 400 .*safetensors", err), err
    assert re.search(rf"failed +mixed-bad-001: {re.escape(str(wrong_rank))}/adapter_\w+\.\w+: 400 .*rank", err), err
    assert re.search(rf"failed +mixed-bad-002: .*not an adapter folder .*{re.escape(str(no_config / 'adapter_config.json'))}", err), err
    assert "4 added, 0 unchanged, 3 failed of 7" in err
    names = registered(stack)
    assert {f.name for f in good} <= names and not {f.name for f in bad} & names

    # Only refusals by the server: exit status 1. The good ones again: unchanged, status 0.
    server_refused = adapters_cli(stack, "add", str(truncated), str(wrong_rank))
    assert server_refused.returncode == 1 and len(re.findall(r"failed +mixed-bad-00[01]: ", server_refused.stderr)) == 2
    again = adapters_cli(stack, "add", *map(str, good))
    assert again.returncode == 0 and again.stdout.count("unchanged") == 4
