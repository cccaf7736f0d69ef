"""First-fit allocator of byte ranges in a fixed-size arena, with coalescing free ranges.

Plain Python over a sorted free list: the arena holds at most a few thousand adapters, and allocation
happens on adapter loads, not per token.
"""
from __future__ import annotations

import bisect


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


class ByteRanges:
    def __init__(self, capacity: int, align: int = 256):
        self.capacity = capacity - capacity % align
        self.align = align
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: list[int] = [self.capacity] if self.capacity else []

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes)

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._sizes))

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new range of at least nbytes (rounded up to the alignment), or None if none fits."""
        size = align_up(max(nbytes, 1), self.align)
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = align_up(max(nbytes, 1), self.align)
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + size) or (
            i > 0 and self._starts[i - 1] + self._sizes[i - 1] > offset
        ):
            raise ValueError(f"range [{offset}, {offset + size}) overlaps free space: double free")
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)
        # Merge with the next and the previous free range where they touch.
        if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)
