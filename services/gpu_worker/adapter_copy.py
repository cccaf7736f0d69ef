"""Adapter loads on CUDA: one host-to-device copy per adapter on a staging stream, at once, then one scatter
of its rows into pool slots on a second stream, after the step in flight; ordered before the next forward
by an event rather than a host sync.

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
        # Two streams: the host-to-device copies never wait for compute, so a round's adapters cross the bus
        # while the step in flight still runs; only the scatter into pool slots waits for that step.
        self.stream = torch.cuda.Stream(device=pool.device)
        self.scatter_stream = torch.cuda.Stream(device=pool.device)
        self._pending: list[torch.cuda.Event] = []

    def copy(self, slots: torch.Tensor, packed: PackedAdapter) -> torch.cuda.Event:
        """Queue the copy; the returned event completes once the host rows have been read (until then the
        caller must keep them, e.g. its pin in the adapter_store's arena)."""
        # The pool rows being overwritten belonged to freed KV or evicted adapters, which a step launched
        # ahead (EngineConfig.overlap_steps) may still read; so the scatter waits for every kernel queued so
        # far, never assuming the last step was synced. The staging copy touches no pool row and need not.
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self.stream):
            # Both device tensors are allocated on the staging stream: one allocated on the compute stream
            # and freed on return could be handed to the next step's inputs and overwritten there before
            # the scatter, waiting behind that step, has read it.
            staged = packed.rows.to(self.pool.device, dtype=self.pool.dtype, non_blocking=True)
            # From pinned memory: a copy from pageable memory would make the host wait for the stream.
            index = (slots.pin_memory() if slots.device.type == "cpu" else slots).to(self.pool.device,
                                                                                       non_blocking=True)
            read = torch.cuda.Event()
            read.record(self.stream)
        self.scatter_stream.wait_event(read)
        self.scatter_stream.wait_event(queued)
        with torch.cuda.stream(self.scatter_stream):
            self.pool.kv[:, :, index] = staged
            landed = torch.cuda.Event()
            landed.record(self.scatter_stream)
        # Freed on return, the staging blocks must not be handed out again on the staging stream before the
        # scatter stream has read them.
        staged.record_stream(self.scatter_stream)
        index.record_stream(self.scatter_stream)
        if slots.device.type == "cuda":
            slots.record_stream(self.stream)
        self._pending.append(landed)
        return read

    def order_before_compute(self) -> None:
        """Make the compute stream wait for every copy issued since the last step."""
        stream = torch.cuda.current_stream(self.pool.device)
        for event in self._pending:
            stream.wait_event(event)
        self._pending.clear()
