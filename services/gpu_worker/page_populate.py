"""Fault in every page of a shared-memory mapping ahead of pinning it, without touching its contents.

cudaHostRegister of a fresh arena segment faults in, zeroes and locks each page on one thread: ~47 s for
48 GiB on an H200 host, after the decode graphs were captured, so a worker started in ~130 s. Populating
the pages first, on a few threads while the graphs are captured (pure system calls, no CUDA), leaves the
pin only locking pages that are already there. MADV_POPULATE_WRITE (Linux 5.14+) maps them writable
as a write fault would, but writes nothing, so the adapter store may be filling the arena meanwhile.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import time

from shared.log import get_logger

log = get_logger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
POPULATE_THREADS = 4

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def populate(address: int, size: int, threads: int = POPULATE_THREADS) -> bool:
    """Fault in [address, address + size) (page-aligned start), split over `threads` threads; False when
    the kernel cannot (older than 5.14, or not Linux): the pin then faults the pages in itself."""
    try:
        madvise = _madvise()
    except (OSError, AttributeError):
        return False
    if size <= 0:
        return True
    page = mmap.PAGESIZE
    step = -(-size // threads // page) * page  # whole pages per thread
    failed: list[int] = []

    def run(start: int) -> None:
        length = min(step, size - start)
        if madvise(address + start, length, MADV_POPULATE_WRITE) != 0:  # ctypes drops the GIL meanwhile
            failed.append(ctypes.get_errno())

    workers = [threading.Thread(target=run, args=(start,), daemon=True) for start in range(0, size, step)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if failed:
        log.info("arena.populate_unsupported", errno=failed[0])  # EINVAL before Linux 5.14: the pin does it
    return not failed


class BackgroundPopulate:
    """populate() of a buffer on a thread of its own; wait() before pinning the buffer."""

    def __init__(self, name: str, buf):
        self.name = name
        # The buffer's address: the mapping stays alive as long as the segment object that owns `buf`.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.size = len(buf)
        self.ok = False
        self.thread = threading.Thread(target=self._run, name=f"populate-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        self.ok = populate(self.address, self.size)
        log.info("arena.populated", segment=self.name, bytes=self.size, ok=self.ok,
                 seconds=round(time.monotonic() - started, 2))

    def wait(self) -> bool:
        self.thread.join()
        return self.ok
