"""Does a fork of a big process silence its own native heartbeat? (The stall issue's lead: a
loader forking its workers.) `python bench/fork_silence.py GIB FORKS`: a child process with GIB
GiB of touched memory beats every 5 ms (replica._C.NativeHeartbeatSender, aimed at a liveness endpoint in
this process) and forks FORKS times; this process samples the child's silence every 1 ms and
prints the forks' durations and the longest silence, as JSON.

Measured on the 2-core development machine (idle), the beat signing on its one thread: 4 GiB,
forks of 89-121 ms, longest silence 118 ms; 12 GiB, forks of 272-346 ms, longest silence 340 ms:
the beat thread was silent for the whole fork (~28 ms a GiB here; a fork write-protects every
private page of the parent, and the beat thread's first write to its stack or heap waited for
the fork to end). With the sender of pre-signed datagrams in memory a fork leaves alone
(csrc/heartbeat.cpp): 4 GiB, forks of 88-100 ms, longest silence 8.5 ms; 12 GiB, forks of
191-233 ms, longest silence 11.2 ms (the period is 5 ms). `tests/test_fork_beats.py` checks it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from replica.jobstore import JobStore
from replica.timing import Deadline

__all__ = ["main"]

TOKEN = b"fork-silence-token"
MEMBER = 7


def _child(port: int, liveness_port: int, gib: float, forks: int, results) -> None:
    store = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), token=TOKEN)
    beat = store.heartbeat_sender(
        MEMBER,
        period=timedelta(milliseconds=5),
        io_timeout=timedelta(seconds=2),
        python_grace=timedelta(seconds=60),
        liveness=("127.0.0.1", liveness_port),
    )
    held = torch.ones(int(gib * 2**30) // 4)  # touched: every page present
    time.sleep(1.0)
    took = []
    for _ in range(forks):
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        took.append(time.perf_counter() - start)
        os.waitpid(pid, 0)
        time.sleep(0.3)
        beat.touch()
    results.put(took)
    time.sleep(0.5)
    beat.stop()
    del held


def main() -> None:
    gib, forks = float(sys.argv[1]), int(sys.argv[2])
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    server = JobStore(master, token=TOKEN).liveness_server("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(master.port, server.port, gib, forks, results))
    child.start()
    deadline = Deadline.after(timedelta(seconds=120))
    while server.ages([MEMBER])[0] < 0 and not deadline.expired:
        time.sleep(0.01)
    longest = 0.0
    while child.is_alive() and results.empty() and not deadline.expired:
        longest = max(longest, server.ages([MEMBER])[0])
        time.sleep(0.001)
    took = results.get(timeout=60)
    child.join(30)
    server.stop()
    print(
        json.dumps(
            {"gib": gib, "fork_ms": [round(t * 1e3, 1) for t in took], "longest_silence_ms": round(longest * 1e3, 1)}
        )
    )


if __name__ == "__main__":
    main()
