"""A host buffer whose memory goes back to the operating system piece by piece as
its contents are used up: what bounds an engine's memory while a received version
is loaded out of it (``WeightReceiver.hold(consume=True)``).

The buffer is an anonymous private mapping of its own. ``consumable`` hands out
views of its tensors, each over a storage of its own (so whatever a loader derives
from a view, a slice or a reinterpretation, keeps that storage alive); once the last
reference to a tensor's storage is gone, the pages that tensor and tensors gone
before it cover entirely are dropped (``MADV_DONTNEED``): the resident memory falls
as the loader copies the version out, and the next receive faults the pages in again.
Pages still referenced are never dropped, whatever happens to the rest.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["PageBuffer"]

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # linux/mman.h; not in Python's mmap module


class PageBuffer:
    """``nbytes`` of zeroed host memory as ``self.tensor`` (uint8), with ``consumable``
    views whose pages are returned once nothing holds them."""

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"need a positive size, got {nbytes}")
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._starts: list[int] = []  # consumed spans since the last reset, merged, sorted
        self._ends: list[int] = []
        self.dropped_bytes = 0  # pages dropped since the last reset (what the resident memory fell by)

    def populate(self) -> bool:
        """Fault every page in now (``MADV_POPULATE_WRITE``, Linux 5.14+; contents kept), so
        the next writer does not take a fault per page; False where the kernel cannot."""
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, 0, self.nbytes)
        except OSError:
            return False
        return True

    def consumable(self, spans: Iterator[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """For each ``(lo, hi)`` of ``spans``, a uint8 tensor over those bytes whose pages
        (with those of spans gone before) are dropped once the view and everything derived
        from it are gone. Starts a fresh account of what was consumed."""
        with self._lock:
            self._starts, self._ends, self.dropped_bytes = [], [], 0
        for lo, hi in spans:
            if not 0 <= lo <= hi <= self.nbytes:
                raise ValueError(f"span {lo}:{hi} is outside the buffer of {self.nbytes} bytes")
            array = np.frombuffer(self._map, dtype=np.uint8, count=hi - lo, offset=lo)
            weakref.finalize(array, self._consumed, lo, hi)
            yield torch.from_numpy(array)  # the tensor's storage holds the array

    def _consumed(self, lo: int, hi: int) -> None:
        if lo == hi:
            return
        with self._lock:
            # Merge [lo, hi) into the consumed spans; drop the pages around it now wholly consumed.
            i = bisect.bisect_left(self._ends, lo)
            j = bisect.bisect_right(self._starts, hi)
            start = min(lo, self._starts[i]) if i < j else lo
            end = max(hi, self._ends[j - 1]) if i < j else hi
            self._starts[i:j], self._ends[i:j] = [start], [end]
            first = max(-(-start // _PAGE), lo // _PAGE) * _PAGE
            last = min(end // _PAGE, -(-hi // _PAGE)) * _PAGE
            if last > first:
                self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
                self.dropped_bytes += last - first
