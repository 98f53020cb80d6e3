"""replica.weights.pagebuffer.PageBuffer: a buffer whose pages go back to the OS as its
contents are used up (the bounded staged apply of an engine's weights)."""

from __future__ import annotations

import gc

import pytest
import torch

from replica.weights.pagebuffer import PageBuffer


def _resident(buf: PageBuffer) -> int:
    """Bytes of the buffer's own mapping in memory (its Rss in /proc/self/smaps): unlike the
    process's RSS, nothing else the test process frees or allocates moves it."""
    address, inside = buf.tensor.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the buffer's mapping is not in /proc/self/smaps")


def test_pages_go_back_once_nothing_holds_them_and_held_ones_stay():
    n = 128 << 20
    buf = PageBuffer(n)
    buf.tensor.fill_(7)
    assert _resident(buf) == n
    spans = [(lo, min(lo + 3_000_001, n)) for lo in range(0, n, 3_000_001)]  # not page-aligned
    kept = []
    for k, ((lo, hi), view) in enumerate(zip(spans, buf.consumable(iter(spans)), strict=False)):
        assert view.numel() == hi - lo and int(view[0]) == 7
        derived = view[1:].view(torch.uint8)
        if k == 5:
            kept.append(derived)  # still referenced: its pages must stay
        del view, derived
    assert 0.9 * n < buf.dropped_bytes < n
    assert _resident(buf) == n - buf.dropped_bytes  # the memory went back as the views went
    assert bool((kept[0] == 7).all())  # intact
    kept.clear()
    gc.collect()
    assert buf.dropped_bytes == n and _resident(buf) == 0  # now its pages went too
    buf.tensor[:4096].fill_(3)
    if buf.populate():  # Linux 5.14+: faulted in ahead of the next writer, contents kept
        assert _resident(buf) == n and int(buf.tensor[0]) == 3 and int(buf.tensor[n - 1]) == 0
    buf.tensor.fill_(1)  # written again: the pages come back
    assert _resident(buf) == n and int(buf.tensor[n // 2]) == 1


def test_bad_sizes_and_spans_are_clear_errors():
    with pytest.raises(ValueError, match="positive size"):
        PageBuffer(0)
    buf = PageBuffer(4096)
    with pytest.raises(ValueError, match="outside the buffer"):
        list(buf.consumable(iter([(0, 8192)])))
