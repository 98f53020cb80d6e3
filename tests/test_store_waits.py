"""Waits on the job store: they block in the store on a connection of the waiting
thread's own (``JobStore.wait_for``), so another thread's store calls never queue
behind them; what wakes them is only a hint (the awaited value is read and verified);
every wait has a deadline."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.errors import CommitTimeoutError, StoreWaitTimeoutError
from replica.jobstore import Commit, JobStore, Number, keys
from replica.jobstore.commit import CommitRecord

TOKEN = b"store-waits-token"
T = timedelta(seconds=30)


def client(server: dist.TCPStore) -> JobStore:
    return JobStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T), token=TOKEN)


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_blocking_wait_holds_no_connection_another_thread_uses(server):
    jobs = client(server)
    key = keys.engine_version(0)
    thread, out = in_thread(lambda: jobs.wait(key, T))
    time.sleep(0.2)  # the waiter is blocked in the store now
    slowest = 0.0
    for i in range(20):  # the waiting thread's JobStore, used from this thread meanwhile
        start = time.monotonic()
        jobs.put(keys.engine_version(1), Number(value=i))
        assert jobs.get(keys.engine_version(1)) == Number(value=i)
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    assert thread.is_alive()  # still waiting the whole time: these calls did not queue behind it
    assert slowest < 1.0, slowest
    written = time.monotonic()
    jobs.put(key, Number(value=7))
    thread.join(10)
    assert out.get("value") == Number(value=7), out
    assert out["at"] - written < 5.0  # woken by the write, not by a poll (a 30 s wait)


def test_a_forged_value_does_not_end_a_wait(server):
    jobs, forger = client(server), dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T)
    key = keys.engine_version(0)
    thread, out = in_thread(lambda: jobs.wait(key, T))
    time.sleep(0.2)
    forger.set(jobs.full(key), b'{"value":999}\n' + b"0" * 64)  # wakes the waiter: it reads, refuses, waits on
    time.sleep(0.5)
    assert thread.is_alive() and "value" not in out
    jobs.put(key, Number(value=3))
    thread.join(10)
    assert out.get("value") == Number(value=3), out


def test_waits_end_at_their_deadline(server):
    jobs = client(server)
    start = time.monotonic()
    with pytest.raises(StoreWaitTimeoutError):
        jobs.wait(keys.engine_version(0), timedelta(milliseconds=300))
    assert time.monotonic() - start < 5.0
    with pytest.raises(CommitTimeoutError):
        CommitRecord(jobs, world_size=1).wait(1, timedelta(milliseconds=300))


def test_a_commit_wait_is_woken_by_the_step_marker_and_can_be_aborted(server):
    trainer, standby = client(server), client(server)
    record = CommitRecord(trainer, world_size=1)
    thread, out = in_thread(lambda: record.wait(3, T))
    for step in (1, 2):
        CommitRecord(standby, world_size=1).acknowledge(0, step)
    time.sleep(0.3)
    assert thread.is_alive()  # steps 1 and 2 committed: not what it waits for
    CommitRecord(standby, world_size=1).acknowledge(0, 3)
    thread.join(10)
    assert out.get("value") == 3, out
    # A forged marker alone wakes nothing: the signed commit is what counts.
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T)
    raw.set(trainer.full(keys.commit_reached(4)), b"")
    raw.set(trainer.full(keys.commit()), b"999")
    with pytest.raises(CommitTimeoutError):
        record.wait(4, timedelta(milliseconds=300))

    class Stop(Exception):
        pass

    calls = []

    def abort() -> None:
        calls.append(time.monotonic())
        if len(calls) > 3:
            raise Stop

    with pytest.raises(Stop):
        record.wait(5, T, abort=abort)


def test_commit_markers_are_kept_for_a_bounded_window(server):
    jobs = client(server)
    record = CommitRecord(jobs, world_size=1)
    for step in range(1, 101):
        assert record.acknowledge(0, step) == step
    present = [s for s in range(1, 101) if jobs.raw.check([jobs.full(keys.commit_reached(s))])]
    assert present == list(range(37, 101))  # the last 64 steps
    assert jobs.get(keys.commit()) == Commit(step=100, generation=0)
    # A resumed job's record starts at the export's step, marked as reached.
    record.seed(500)
    assert record.wait(500, timedelta(seconds=1)) == 500
