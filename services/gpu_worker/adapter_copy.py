"""Adapter loads on CUDA: one host-to-device copy per adapter on a side stream, then one scatter of its
rows into pool slots, ordered before the next forward by an event rather than a host sync.

One large copy from pinned (or cudaHostRegister-ed arena) memory runs near the bus bandwidth; copying
an adapter row by row is several times slower, hence the staging buffer.
"""
from __future__ import annotations

import torch

from .adapter_layout import PackedAdapter
from .pool import UnifiedPool


class SideStreamCopier:
    def __init__(self, pool: UnifiedPool):
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)
        self._pending: list[torch.cuda.Event] = []

    def copy(self, slots: torch.Tensor, packed: PackedAdapter) -> torch.cuda.Event:
        """Queue the copy; the returned event completes once the host rows have been read (until then the
        caller must keep them, e.g. its pin in the adapter_store's arena)."""
        # The pool rows being overwritten belonged to freed KV or evicted adapters. A step launched ahead
        # (EngineConfig.overlap_steps) may still be running when an admission loads an adapter, so the copy
        # waits for every kernel queued so far rather than assuming the last step was synced.
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self.stream):
            # Both device tensors are allocated on this stream: one allocated on the compute stream and
            # freed on return could be handed to the next step's inputs and overwritten there before this
            # stream, still waiting behind that step, has read it.
            staged = packed.rows.to(self.pool.device, dtype=self.pool.dtype, non_blocking=True)
            # From pinned memory: a copy from pageable memory would wait for this stream, and so for the step
            # in flight, on the host.
            index = (slots.pin_memory() if slots.device.type == "cpu" else slots).to(self.pool.device,
                                                                                       non_blocking=True)
            self.pool.kv[:, :, index] = staged
            event = torch.cuda.Event()
            event.record(self.stream)
        if slots.device.type == "cuda":
            slots.record_stream(self.stream)
        self._pending.append(event)
        return event

    def order_before_compute(self) -> None:
        """Make the compute stream wait for every copy issued since the last step."""
        stream = torch.cuda.current_stream(self.pool.device)
        for event in self._pending:
            stream.wait_event(event)
        self._pending.clear()
