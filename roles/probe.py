"""A second look at a role the heartbeats say is dead, through a channel that does not share
their fate: its agent's view of the process (``/proc/PID/stat``: gone? stopped? running, or
using CPU?). A silence past the deadline is confirmed only when the process is gone, stopped
(SIGSTOP, a debugger) or idle (asleep and using no CPU: nothing in it runs to send a beat); a
process that runs or waits in the kernel (a fork copying page tables, reclaim under memory
pressure, an fsync) is stalled, not dead."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass

__all__ = ["ProcessState", "ProcessView", "Verdict", "by_host", "judge", "look", "verdict_of"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class ProcessState(enum.StrEnum):
    GONE = "gone"  # no such process, or a zombie
    STOPPED = "stopped"  # SIGSTOP, a tracer (T, t)
    RUNNING = "running"  # on a CPU or ready to run (R)
    WAITING = "waiting"  # in the kernel, uninterruptible (D): I/O, a lock of its memory map, reclaim
    SLEEPING = "sleeping"  # waiting for an event (S, I)


@dataclass(kw_only=True, frozen=True, slots=True)
class ProcessView:
    """A process as ``/proc`` showed it at ``at`` (``time.monotonic()``): its state, and the
    CPU time all its threads used so far (``cpu_s``, at the kernel's 10 ms ticks)."""

    pid: int
    state: ProcessState
    cpu_s: float
    at: float


class Verdict(enum.StrEnum):
    GONE = "gone"  # the process, or its host, is gone: a death whatever else is silent
    DEAD = "dead"  # stopped or idle: the silence is a death
    STALLED = "stalled"  # running or waiting in the kernel: a stall, not a death
    UNKNOWN = "unknown"  # no second channel (no agent sees the process): the deadline alone decides


_STATES = {
    "R": ProcessState.RUNNING,
    "D": ProcessState.WAITING,
    "S": ProcessState.SLEEPING,
    "I": ProcessState.SLEEPING,
    "T": ProcessState.STOPPED,
    "t": ProcessState.STOPPED,
    "Z": ProcessState.GONE,
    "X": ProcessState.GONE,
    "x": ProcessState.GONE,
}


def look(pid: int) -> ProcessView:
    """``pid`` as ``/proc`` shows it now; the busiest of its threads' states (a process is
    RUNNING when any thread runs, WAITING when any waits in the kernel)."""
    now = time.monotonic()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return ProcessView(pid=pid, state=ProcessState.GONE, cpu_s=0.0, at=now)
    state = _STATES.get(fields[0].decode(), ProcessState.SLEEPING)
    cpu = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)
    if state == ProcessState.SLEEPING:  # the process's own letter is its main thread's: look at the others
        state = max((_thread_state(pid, tid) for tid in _threads(pid)), key=_BUSY.index, default=state)
    return ProcessView(pid=pid, state=state, cpu_s=cpu, at=now)


_BUSY = [ProcessState.GONE, ProcessState.SLEEPING, ProcessState.STOPPED, ProcessState.WAITING, ProcessState.RUNNING]


def _threads(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _thread_state(pid: int, tid: str) -> ProcessState:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            letter = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ProcessState.GONE
    return _STATES.get(letter, ProcessState.SLEEPING)


def judge(before: ProcessView | None, after: ProcessView) -> tuple[Verdict, str]:
    """The verdict on a silent role from two looks at its process (``before`` may be None:
    then CPU use is not known), and why, in words for the log and the report."""
    if after.state == ProcessState.GONE:
        return Verdict.GONE, "its process is gone"
    if after.state == ProcessState.STOPPED:
        return Verdict.DEAD, "its process is stopped"
    if before is None or before.state == ProcessState.GONE:
        used, span = None, 0.0  # (span: the seconds between the looks, said only with the CPU used)
    else:
        used, span = after.cpu_s - before.cpu_s, after.at - before.at
    if after.state in (ProcessState.RUNNING, ProcessState.WAITING):
        return Verdict.STALLED, f"its process is {after.state}" + (
            f" ({used:.2f} s of CPU in {span:.1f} s)" if used else ""
        )
    if used:
        return Verdict.STALLED, f"its process used {used:.2f} s of CPU in the last {span:.1f} s"
    return Verdict.DEAD, "its process sleeps and uses no CPU"


def verdict_of(views: dict[int, ProcessView], pid: int, *, min_gap_s: float = 0.1) -> tuple[Verdict, str]:
    """Look at ``pid`` now and judge it against the last look kept in ``views`` (at least
    ``min_gap_s`` older; a look that old is taken first when none is), keeping the new one."""
    before = views.get(pid)
    if before is None or time.monotonic() - before.at < min_gap_s:
        first = look(pid) if before is None else before
        time.sleep(max(0.0, min_gap_s - (time.monotonic() - first.at)))
        before = first
    after = views[pid] = look(pid)
    return judge(before, after)


def by_host(host: str, silent_hosts: set[str]) -> tuple[Verdict, str]:
    """The verdict of an agent that sees hosts, not their processes: gone with its host
    (whose agent is silent too), else unknown."""
    if host in silent_hosts:
        return Verdict.GONE, "its host's agent is silent too"
    return Verdict.UNKNOWN, ""
