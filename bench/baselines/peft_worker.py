"""The PEFT baseline's one GPU thread: 1) take the next adapter group 2) make the adapter active
3) run the padded batch to completion, handing each decode step's tokens to the event loop.

All model work is serialised here; the event loop only queues requests and streams what this thread posts.
Each step's tokens for the whole batch go to the loop in one call, so waking the loop costs one write per
step, not one per request.
"""
from __future__ import annotations

import asyncio
import threading
import time

from bench.baselines.grouping import BatchLog, BatchRecord, GroupingQueue, PendingRequest
from bench.baselines.peft_model import AdapterCache, GreedyRunner
from shared.log import get_logger

log = get_logger("peft_baseline")


def _deliver(items: list[tuple[PendingRequest, object]]) -> None:
    for request, item in items:
        if not request.cancelled:
            request.sink(item)


class BatchWorker(threading.Thread):
    def __init__(self, queue: GroupingQueue, cache: AdapterCache, runner: GreedyRunner, batches: BatchLog,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(name="peft-batch-worker", daemon=True)
        self.queue = queue
        self.cache = cache
        self.runner = runner
        self.batches = batches
        self.loop = loop
        self.running = 0  # requests in the batch on the GPU now (for /metrics)

    def _post(self, items: list[tuple[PendingRequest, object]]) -> None:
        if items:
            try:
                self.loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # the loop has closed: the server is gone, nobody is waiting

    def run(self) -> None:
        while True:
            batch = self.queue.take_batch()
            if batch is None:
                return
            self.running = len(batch)
            try:
                self._run_batch(batch)
            finally:
                self.running = 0

    def _run_batch(self, batch: list[PendingRequest]) -> None:
        adapter = batch[0].adapter
        record = BatchRecord(adapter=adapter, request_ids=[r.request_id for r in batch],
                             prompt_lens=[len(r.prompt_ids) for r in batch], max_tokens=[r.max_tokens for r in batch])
        generated = 0

        def on_step(step: int, tokens: list[int]) -> bool:
            nonlocal generated
            items = []
            for request, token in zip(batch, tokens):
                if not request.live:
                    continue  # its output was cut at max_tokens or EOS; the row still runs with the batch
                request.emitted += 1
                generated += 1
                reason = None
                if request.emitted >= request.max_tokens:
                    reason = "length"
                elif token in request.stop_token_ids:
                    reason = "stop"
                if reason is not None:
                    request.finished = True
                items.append((request, (token, reason)))
            self._post(items)
            return any(r.live for r in batch)

        started = time.monotonic()
        try:
            with self.cache.activate(adapter):
                loaded_at = time.monotonic()
                record.load_s = loaded_at - started
                record.steps = self.runner.run(self.cache.model, [r.prompt_ids for r in batch],
                                               max(r.max_tokens for r in batch), on_step)
            record.run_s = time.monotonic() - loaded_at
        except Exception as e:  # a failed batch fails its requests; the server keeps serving the others
            log.exception("batch failed", adapter=adapter, size=len(batch))
            record.error = f"{type(e).__name__}: {e}"
            failed = [r for r in batch if r.live]
            for r in failed:
                r.finished = True
            self._post([(r, f"generation failed: {record.error}") for r in failed])
        self.batches.add(record, generated)
        log.debug("batch done", adapter=adapter, size=len(batch), steps=record.steps,
                  load_s=round(record.load_s, 4), run_s=round(record.run_s, 4))
