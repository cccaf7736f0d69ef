"""Heavy request work on a bounded thread pool, with its answers handed back to the store's loop.

A ZeroMQ socket belongs to one thread, and the arena and pin tables are the loop's alone, so a pool
thread only computes: `work()` runs on the pool, `finish(outcome)` later runs on the loop, which is
woken through a pipe it polls beside its socket. Hashing, safetensors parsing and the tensor checks
release the GIL on large buffers, so registrations on the pool really run side by side.
"""
from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Offloaded:
    """A handler's answer that needs heavy work first: `work` runs on a pool thread and `finish(its
    result)` on the loop thread, returning the reply."""

    work: Callable[[], Any]
    finish: Callable[[Any], Any]
    pool: str = "register"  # which of the store's pools runs `work` (registrations, or loads for workers)
    reads: tuple[str, ...] = ()  # adapters `work` reads from disk: acquires of them join it (store.loading)


@dataclass
class Join:
    """A handler's answer for an acquire that must wait on a read under way: of its own adapter (answered
    once that read is laid in: one read of each adapter, however many workers and hints ask at once), or for
    a free load thread (the store's LOAD_QUEUE key: asked again, in order, as each read ends)."""

    adapter: str


class Offload:
    def __init__(self, workers: int, name: str = "offload"):
        if workers < 1:
            raise ValueError(f"need at least one worker thread, got {workers}")
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._done: queue.SimpleQueue[tuple[Callable[[Future], None], Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def fd(self) -> int:
        """Readable when finished work waits for run_finished()."""
        return self._wake_r

    def submit(self, work: Callable[[], Any], on_done: Callable[[Future], None]) -> None:
        """Run `work` on the pool; `on_done(its future)` then runs on the loop, in run_finished()."""
        future = self.pool.submit(work)
        future.add_done_callback(lambda f: self._finished(on_done, f))

    def _finished(self, on_done: Callable[[Future], None], future: Future) -> None:
        self._done.put((on_done, future))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the loop is bound to look

    def run_finished(self, limit: int | None = None) -> int:
        """On the loop thread: call on_done for finished work, at most `limit` pieces (None: until none is
        left); how many ran. With a limit the loop gets back to its socket between batches: loads that keep
        finishing while it lays earlier ones into the arena must not keep it from reading requests (it read
        nothing for seconds under churn). Work left over keeps `fd` readable."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        count = 0
        while limit is None or count < limit:
            try:
                on_done, future = self._done.get_nowait()
            except queue.Empty:
                return count
            count += 1
            on_done(future)
        if not self._done.empty():
            self._wake()
        return count

    def close(self) -> None:
        """Let running work finish (its effects are durable), drop what has not started, then answer
        what finished."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.run_finished()
        os.close(self._wake_r)
        os.close(self._wake_w)
