"""ResilientProcessGroup on its own (one member, gloo): collectives go to the
current generation's inner group; abort() fails the generation without
raising, later collectives of it return at once, and the next generation works.
Its NCCL side (failures found by check(), aborts that never block the caller,
the watchdog told not to kill survivors) against a stand-in backend here; on a
real GPU in tests/test_gpu_resilient.py."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from replica.distributed import resilient
from replica.distributed.resilient import ResilientProcessGroup, _device_type
from replica.timing import Deadline


def make_group(**kw) -> ResilientProcessGroup:
    return ResilientProcessGroup(store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5),
                                 name="test-resilient", **{"cuda": False, **kw})


def allreduce(group: ResilientProcessGroup, value: float) -> torch.Tensor:
    t = torch.tensor([value])
    group.allreduce([t], dist.AllreduceOptions()).wait()
    return t


def test_generations_abort_and_recovery():
    group = make_group()
    seen = []
    group.on_collective = seen.append
    allreduce(group, 1.0)
    assert group.errored is not None  # no generation connected yet: recorded, not raised
    group.configure(0)
    assert group.errored is None and allreduce(group, 2.0).item() == 2.0
    assert group.check() is None  # gloo only: nothing asynchronous to find
    assert group.abort("test failover", wait=timedelta(seconds=1))  # nothing to abort on a thread
    assert "aborted: test failover" in str(group.errored) and group.check() is group.errored
    assert allreduce(group, 3.0).item() == 3.0  # returned at once, no communication
    group.configure(1)
    assert group.generation == 1 and group.errored is None
    assert allreduce(group, 4.0).item() == 4.0
    assert seen == ["allreduce"] * 4
    with pytest.raises(ValueError, match="not newer"):
        group.configure(1)
    assert group.nccl_timeout == timedelta(seconds=15)  # 3x the gloo timeout unless given
    group.shutdown()


def test_members_that_start_far_apart_connect_the_first_generation():
    """Trainers start seconds apart (a loaded machine, Ray starting actors one by one): with
    ``ready_timeout`` the first generation waits for every member before gloo's rendezvous,
    whose own timeout (1 s here) the late one missed by far. (Without it a trainer on an
    etcd store, a Python store under gloo, died of SIGABRT: pybind11 restored gloo's timeout
    error twice.)"""
    store = dist.HashStore()
    groups: dict[int, ResilientProcessGroup] = {}
    errors: list[BaseException] = []

    def member(rank: int, late_s: float) -> None:
        time.sleep(late_s)
        try:
            group = ResilientProcessGroup(store=store, rank=rank, world_size=2, timeout=timedelta(seconds=1),
                                          name=f"test-late-{rank}", cuda=False)
            group.configure(0, ready_timeout=timedelta(seconds=30))
            groups[rank] = group
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r, 3.0 * r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(groups) == [0, 1], errors
    results = [None, None]
    sums = [threading.Thread(target=lambda r=r: results.__setitem__(r, allreduce(groups[r], r + 1.0).item()))
            for r in range(2)]
    for t in sums:
        t.start()
    for t in sums:
        t.join(30)
    assert results == [3.0, 3.0]
    for group in groups.values():
        group.shutdown()


def test_barrier_takes_its_options_as_a_keyword():
    """torch.distributed.barrier() (and so torch.distributed.checkpoint's save) passes opts=."""
    group = make_group()
    group.configure(0)
    group.barrier(opts=dist.BarrierOptions()).wait()
    assert group.errored is None
    group.shutdown()


def test_an_abort_ends_a_gloo_wait_on_a_silent_peer():
    """A peer whose host is lost sends no reset, so gloo waits for its own timeout (10 s
    here); abort() (the coordinator announced the failover) ends the survivor's wait at once,
    and the group's next generation is built without waiting for the abandoned collective
    (gloo's destructor would: it joins its threads)."""
    store = dist.HashStore()
    groups = [ResilientProcessGroup(store=store, rank=r, world_size=2, timeout=timedelta(seconds=10),
                                    name=f"test-silent-{r}", cuda=False) for r in range(2)]

    def in_both(fn) -> list:
        out = [None, None]
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(groups[r], r))) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    in_both(lambda g, r: g.configure(0))
    assert [t.item() for t in in_both(lambda g, r: allreduce(g, r + 1.0))] == [3.0, 3.0]  # connected
    # Rank 1 goes silent: rank 0's next collective has no partner.
    work = groups[0].allreduce([torch.ones(1)], dist.AllreduceOptions())
    aborter = threading.Timer(0.3, groups[0].abort, args=("the coordinator announced a failover",))
    started = time.monotonic()
    aborter.start()
    work.wait()
    waited = time.monotonic() - started
    assert "aborted: the coordinator announced a failover" in str(groups[0].errored)
    assert waited < 5.0, f"the aborted wait took {waited:.1f} s (gloo's own timeout is 10 s)"
    # The next generation (rank 1: the promoted standby, say) is built while the abandoned
    # collective is still pending in the old one, and works.
    started = time.monotonic()
    in_both(lambda g, r: g.configure(1))
    assert time.monotonic() - started < 5.0, "the old generation's gloo group held up the new one"
    assert [t.item() for t in in_both(lambda g, r: allreduce(g, 10.0 * (r + 1)))] == [30.0, 30.0]
    assert all(g.errored is None for g in groups)
    for group in groups:
        group.shutdown()


def test_device_of_a_collective():
    cpu = torch.zeros(1)
    assert _device_type(([cpu], object())) == "cpu"
    assert _device_type(([[cpu]],)) == "cpu"
    assert _device_type((1, "x")) == ""


def test_nccl_watchdog_is_told_to_keep_survivors_alive(monkeypatch, caplog):
    for name in (*resilient._ERROR_HANDLING, resilient._DUMP_ON_TIMEOUT, resilient._DUMP_WAIT):
        monkeypatch.delenv(name, raising=False)
    resilient._nccl_environment()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the communicator, not the process
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # no dump signal left in the store for later processes
    assert os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "100"  # nor a minute's wait for a dump
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    with caplog.at_level(logging.WARNING, logger="replica.distributed.resilient"):
        resilient._nccl_environment()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "2 is expected" in caplog.text  # the user's, kept
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "2")  # the older spelling counts as a choice too
    resilient._nccl_environment()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


class FakeWork:
    """An NCCL work as the group sees it: wait() never blocks, and a failure shows
    in is_completed()/exception() some time later."""

    def __init__(self):
        self.done = False
        self.error: Exception | None = None

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done or self.error is not None

    def exception(self) -> Exception | None:
        return self.error


class FakeNccl:
    """Stands in for one generation's ProcessGroupNCCL; its abort() blocks until released."""

    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self.works: list[FakeWork] = []
        self.error = "SUCCESS"
        self.release = threading.Event()
        self.aborted_on: list[str] = []

    def allreduce(self, tensors, opts) -> FakeWork:
        self.works.append(FakeWork())
        return self.works[-1]

    def get_error(self):
        return SimpleNamespace(name=self.error)

    def abort(self) -> None:
        self.aborted_on.append(threading.current_thread().name)
        self.release.wait(30)


@pytest.fixture()
def nccl_group(monkeypatch):
    backends: list[FakeNccl] = []

    def fake_nccl(store, rank, size, timeout):
        backends.append(FakeNccl(timeout))
        return backends[-1]

    monkeypatch.setattr(resilient, "_nccl", fake_nccl)
    monkeypatch.setattr(resilient, "_device_type", lambda args: "cuda")  # every collective is a CUDA one
    group = make_group(cuda=True, nccl_timeout=timedelta(seconds=40))
    yield group, backends
    for backend in backends:
        backend.release.set()
    group.shutdown()


def test_nccl_failures_are_found_by_check(nccl_group):
    group, backends = nccl_group
    group.configure(0)
    assert backends[0].timeout == timedelta(seconds=40)
    allreduce(group, 1.0)
    allreduce(group, 2.0)
    first, second = backends[0].works
    assert group.check() is None  # still running: not a failure
    first.done = True
    assert group.check() is None and list(group._works) == [second]  # finished ones are dropped
    second.error = RuntimeError("NCCL communicator error: remote process exited")  # the fault
    assert group.errored is None  # a plain read does not poll
    assert group.check() is second.error and group.errored is second.error

    backends[0].release.set()
    group.configure(1)  # the failed generation's communicator is aborted, on a thread of its own
    assert backends[0].aborted_on and backends[0].aborted_on[0].startswith("replica-abort")
    assert group.errored is None and group.check() is None
    backends[1].error = "TIMEOUT"  # the watchdog's verdict, with no work left to tell
    assert "TIMEOUT" in str(group.check())


def test_nccl_abort_never_blocks_the_caller(nccl_group):
    group, backends = nccl_group
    group.configure(0)
    allreduce(group, 1.0)
    start = time.monotonic()
    assert not group.abort("the coordinator announced a failover", wait=timedelta(milliseconds=100))
    assert time.monotonic() - start < 2  # ncclCommAbort hangs here, the caller does not
    assert "announced a failover" in str(group.errored)
    deadline = Deadline.after(timedelta(seconds=10))
    while not backends[0].aborted_on and not deadline.expired:
        time.sleep(0.01)
    assert backends[0].aborted_on  # the abort did start
    assert allreduce(group, 2.0).item() == 2.0 and len(backends[0].works) == 1  # nothing posted any more
    backends[0].release.set()
    assert group.abort("again", wait=timedelta(seconds=10))  # finished; no second abort queued
    assert len(backends[0].aborted_on) == 1
    group.configure(1)
    assert len(backends[0].aborted_on) == 1  # configure did not abort it again
