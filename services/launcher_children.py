"""Child processes of the launcher: started so they die with it, probed for readiness, stopped in order.

Every child is started in its own session (a terminal's Ctrl-C reaches only the launcher, which then stops
the children in order) with PR_SET_PDEATHSIG, so the kernel sends it SIGTERM the moment the launcher dies,
even by SIGKILL: no orphans. Python services also watch their parent pid, which covers the one case the
kernel signal misses (the launcher dying between fork and prctl) and platforms without prctl.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from shared.log import get_logger

log = get_logger("launcher")

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: the kernel sends the child SIGTERM when `parent_pid` dies (Linux PR_SET_PDEATHSIG), so no
    child outlives the process that started it."""
    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: the services' own parent-pid watch still applies
        if os.getppid() != parent_pid:
            os._exit(1)  # the launcher died before prctl took effect
    return preexec


class ChildFailed(RuntimeError):
    """Startup failed; `status` and `child`: the exit status and name of the child that ended it, if one exited."""

    def __init__(self, message: str, status: int | None = None, child: str | None = None):
        super().__init__(message)
        self.status = status
        self.child = child


@dataclass(eq=False)
class Child:
    """One supervised process. `ready(child)` says whether it serves yet; `before_start(child)` clears what a
    previous incarnation left (a stale ready file, an orphaned arena segment)."""

    name: str
    argv: list[str]
    ready: Callable[["Child"], bool]
    env: dict[str, str] | None = None
    cwd: str | None = None
    before_start: Callable[["Child"], None] | None = None
    after_exit: Callable[["Child"], None] | None = None
    alive_check: Callable[["Child"], bool] | None = None  # False = hung: killed and restarted
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    is_ready: bool = False
    deaths: list[float] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.before_start is not None:
            self.before_start(self)
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, start_new_session=True,
                                     preexec_fn=die_with_parent(os.getpid()))
        self.started_at = time.monotonic()
        self.is_ready = False
        log.info("child.started", child=self.name, pid=self.proc.pid)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def probe(self) -> bool:
        """Ready now? Never raises: a probe that fails means not ready yet."""
        if not self.running():
            return False
        try:
            self.is_ready = bool(self.ready(self))
        except Exception:
            self.is_ready = False
        return self.is_ready

    def wait_ready(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe():
            if not self.running():
                code = self.proc.returncode if self.proc is not None else None
                raise ChildFailed(f"{self.name} exited with status {code} before it was ready", code, self.name)
            if cancelled():
                raise ChildFailed(f"startup cancelled while waiting for {self.name}")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.name} was not ready within {timeout_s:g}s")
            time.sleep(0.05)
        log.info("child.ready", child=self.name, pid=self.pid, seconds=round(time.monotonic() - self.started_at, 2))

    def signal(self, sig: int) -> None:
        if self.running():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> bool:
        """True when the process has exited within timeout_s."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:
            return False

    def reap(self) -> None:
        """After the process exited: run the cleanup hook once."""
        if self.after_exit is not None and self.proc is not None:
            try:
                self.after_exit(self)
            except Exception as e:
                log.warning("child.cleanup_failed", child=self.name, error=str(e))


def stop_children(children: list[Child], timeout_s: float) -> None:
    """SIGTERM them all, wait together up to timeout_s, SIGKILL the stragglers."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if not child.wait(deadline - time.monotonic()):
            log.warning("child.kill", child=child.name, pid=child.pid, reason=f"still running {timeout_s:g}s after SIGTERM")
            child.signal(signal.SIGKILL)
            child.wait(5.0)
        child.reap()
