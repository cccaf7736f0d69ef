"""Work on the store's pool threads, answered on its loop a few pieces per pass."""
from __future__ import annotations

import select
import time

from services.adapter_store.offload import Offload


def test_finished_work_is_answered_at_most_limit_per_pass_and_the_rest_keeps_the_loop_awake():
    pool = Offload(2, "test")
    answered: list[int] = []
    try:
        for i in range(10):
            pool.submit(lambda i=i: i * i, lambda future: answered.append(future.result()))
        deadline = time.monotonic() + 10
        while pool._done.qsize() < 10:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert select.select([pool.fd], [], [], 0)[0]
        assert pool.run_finished(4) == 4 and len(answered) == 4
        assert select.select([pool.fd], [], [], 0)[0]  # six still waiting: the loop's poll wakes at once
        assert pool.run_finished(4) == 4
        assert pool.run_finished(4) == 2
        assert not select.select([pool.fd], [], [], 0)[0]  # nothing left: the loop may sleep
        assert sorted(answered) == [i * i for i in range(10)]
        assert pool.run_finished() == 0
    finally:
        pool.close()
