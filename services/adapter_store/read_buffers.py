"""One reusable read buffer per load thread.

A load reads a blob whole, views its tensors in place and packs them into the arena at once. A fresh
buffer per read costs more than the read itself: Python zero-fills it and the kernel faults its pages in
(48 ms of a 62 ms read of an 84 MB S-GQA blob on one core, against 17 ms into a buffer already touched).
So each thread keeps the buffer of its last read and reads the next blob into it. The tensors a read
returns view that buffer: they are valid until the same thread reads again, which is why only callers that
pack them before their next read use it.
"""
from __future__ import annotations

import threading

# Buffers grow in steps this large, so adapters of mixed ranks do not reallocate at every larger one.
GROWTH = 32 * 2**20


class ReadBuffers:
    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """This thread's buffer, at least `nbytes` long, as a view of exactly `nbytes`."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            self._local.buf = None  # the old one is freed before the larger one is made
            buf = bytearray(-(-nbytes // GROWTH) * GROWTH)
            self._local.buf = buf
        return memoryview(buf)[:nbytes]

    def held_bytes(self) -> int:
        """Bytes of the calling thread's buffer (0 before its first read)."""
        buf = getattr(self._local, "buf", None)
        return 0 if buf is None else len(buf)
