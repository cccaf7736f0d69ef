"""Scheduler processes started on demand, each stopped when its test ends."""
import pytest

from tests.scheduler.peers import SchedulerProcess


@pytest.fixture
def start(tmp_path):
    procs = []

    def _start(**options):
        proc = SchedulerProcess(tmp_path, **options)
        procs.append(proc)
        proc.wait_ready()
        return proc

    yield _start
    for proc in procs:
        proc.stop()
