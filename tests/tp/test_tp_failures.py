"""A TP group with a rank down: rank 0 says which rank failed and why instead of hanging, and followers do not
outlive rank 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from services.gpu_worker.tp import TPEngine, TPRankError
from services.gpu_worker.tp.plan import STEP
from shared.config import EngineConfig
from shared.tiny_model import make_model

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tp-fail") / "model", preset="tiny", seed=2)


def request(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))


def gone(pid: int) -> bool:
    """Exited (a zombie awaiting its parent's wait counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_follower_fails_the_next_step_naming_the_rank(base):
    engine = TPEngine.from_model_dir(base, EngineConfig(), tp_size=2, log_level="warning")
    try:
        engine.add_request(request(0))
        engine.step()
        follower = engine.followers.procs[1]
        follower.kill()
        follower.wait()
        with pytest.raises(TPRankError, match=r"rank 1 exited with code -9"):
            engine.step()
    finally:
        engine.shutdown()
    assert engine.followers is None


def test_a_follower_that_cannot_run_a_plan_reports_why(base):
    engine = TPEngine.from_model_dir(base, EngineConfig(), tp_size=2, log_level="warning")
    try:
        engine.followers.channel.send(1, STEP, b"\xc1 not msgpack")
        engine.followers.procs[1].wait(20)
        engine.add_request(request(0))
        with pytest.raises(TPRankError, match=r"rank 1 exited with code 1: .*PlanError: unreadable step plan header \(\w+"):
            engine.step()
    finally:
        engine.shutdown()


def test_followers_exit_when_rank_zero_dies(base, tmp_path):
    pid_file = tmp_path / "pids"
    code = (
        "import sys, time\n"
        "from services.gpu_worker.tp import TPEngine\n"
        "from shared.config import EngineConfig\n"
        f"e = TPEngine.from_model_dir({str(base)!r}, EngineConfig(), tp_size=2, log_level='warning')\n"
        f"open({str(pid_file)!r}, 'w').write(str(e.followers.procs[1].pid))\n"
        "time.sleep(300)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert leader.poll() is None, "rank 0 process died during startup"
            time.sleep(0.2)
        follower_pid = int(pid_file.read_text())
        assert not gone(follower_pid)
        leader.send_signal(signal.SIGKILL)  # no cleanup code runs in rank 0
        leader.wait()
        assert wait_gone(follower_pid, 15), "follower outlived rank 0"
    finally:
        if leader.poll() is None:
            leader.kill()
