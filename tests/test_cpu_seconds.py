"""support.cpu.cpu_seconds: the process CPU clock the benchmarks' core accounting
reads (every thread of a process, at nanosecond resolution)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from replica.timing import Deadline
from support.cpu import cpu_seconds, cpu_since


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_counts_every_thread_of_this_process():
    before, meter = cpu_seconds(), cpu_since()
    worker = threading.Thread(target=_spin, args=(0.05,))
    worker.start()
    worker.join()
    assert cpu_seconds() - before >= 0.05  # the other thread's time counts too
    assert meter() >= 0.05


def test_another_process_at_fine_resolution_then_gone():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(60)",
        ]
    )
    try:
        meter = cpu_since(child.pid)
        deadline = Deadline.after(timedelta(seconds=60))
        while (used := cpu_seconds(child.pid)) < 0.3:  # a loaded machine may run it late
            assert not deadline.expired, f"the child used only {used} s"
            time.sleep(0.05)
        assert used != round(used, 2)  # nanoseconds, not /proc's 10 ms ticks
        assert meter() > 0.1  # the child spun since the meter started (Python starts in well under 0.2 s)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        cpu_seconds(child.pid)
