"""CPU time of processes (the benchmarks' core accounting) and a machine made busy on
purpose (``busy_cores``: a user's loaded machine)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["BusyCores", "busy_cores", "cpu_seconds", "cpu_since"]


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time every thread of process ``pid`` (this one when None) used so far, in
    seconds at the kernel's resolution (nanoseconds; /proc's ticks are 10 ms). Through
    the process's CPU clock (Linux: the clock id of ``clock_getcpuclockid``, which Python
    lacks). OSError once the process is gone."""
    if pid is None:
        return time.process_time()
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the whole process


def cpu_since(*pids: int) -> Callable[[], float]:
    """A meter started now: each call returns the CPU seconds this process and ``pids``
    used since (every thread; see ``cpu_seconds``)."""

    def used() -> float:
        return cpu_seconds() + sum(cpu_seconds(pid) for pid in pids)

    start = used()
    return lambda: used() - start


@dataclass(kw_only=True, frozen=True, slots=True)
class BusyCores:
    """Processes spinning at normal priority, as a user's loaded machine would have."""

    procs: tuple[subprocess.Popen, ...]
    started: float

    def all_alive(self) -> bool:
        """True while every one still runs (the load lasted, for a test to assert)."""
        return all(p.poll() is None for p in self.procs)

    def cpu_seconds(self) -> float:
        """CPU time they used so far: proof that they competed for the cores."""
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(OSError):  # one already gone
                total += cpu_seconds(p.pid)
        return total


@contextlib.contextmanager
def busy_cores(per_core: int = 2) -> Iterator[BusyCores]:
    """``per_core`` busy-looping processes per core for the whole block, always killed after."""
    n = per_core * (os.cpu_count() or 1)
    procs = tuple(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n))
    try:
        yield BusyCores(procs=procs, started=time.monotonic())
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
