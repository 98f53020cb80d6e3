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
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from replica.distributed import resilient
from replica.distributed.resilient import ResilientProcessGroup
from replica.distributed.works import device_type
from replica.timing import Deadline
from support.resilient import allreduce, make_group


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
            group = ResilientProcessGroup(
                store=store, rank=rank, world_size=2, timeout=timedelta(seconds=1), name=f"test-late-{rank}", cuda=False
            )
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
    sums = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, allreduce(groups[r], r + 1.0).item()))
        for r in range(2)
    ]
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


def _in_all(groups: list[ResilientProcessGroup], fn) -> list:
    """``fn(group, rank)`` on a thread per rank (the ranks of one process's groups), its results."""
    out = [None] * len(groups)
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(groups[r], r))) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _groups(name: str, world: int, timeout_s: float = 10) -> list[ResilientProcessGroup]:
    store = dist.HashStore()
    groups = [
        ResilientProcessGroup(
            store=store, rank=r, world_size=world, timeout=timedelta(seconds=timeout_s), name=f"{name}-{r}", cuda=False
        )
        for r in range(world)
    ]
    _in_all(groups, lambda g, r: g.configure(0))
    return groups


# Every CPU collective FSDP2 and replica post, as rank 0 of 2 posts it alone (its peer gone silent).
_SILENT_PEER = {
    "allreduce": lambda g: g.allreduce([torch.ones(4)], dist.AllreduceOptions()),
    "reduce_scatter_tensor": lambda g: g._reduce_scatter_base(
        torch.empty(2), torch.ones(4), dist.ReduceScatterOptions()
    ),
    "reduce_scatter": lambda g: g.reduce_scatter(
        [torch.empty(2)], [[torch.ones(2), torch.ones(2)]], dist.ReduceScatterOptions()
    ),
    "all_gather_into_tensor": lambda g: g._allgather_base(torch.empty(4), torch.ones(2), c10d.AllgatherOptions()),
    "allgather": lambda g: g.allgather([[torch.empty(2), torch.empty(2)]], [torch.ones(2)], c10d.AllgatherOptions()),
    "broadcast": lambda g: g.broadcast([torch.ones(2)], dist.BroadcastOptions()),
    "barrier": lambda g: g.barrier(opts=dist.BarrierOptions()),
}


@pytest.mark.parametrize("collective", list(_SILENT_PEER))
def test_an_abort_ends_a_gloo_wait_on_a_silent_peer(collective):
    """A peer whose host is lost sends no reset, so gloo waits for its own timeout (10 s
    here); abort() (the coordinator announced the failover) ends the survivor's wait at once,
    in every collective (gloo's reduce-scatters ignore a wait's timeout: they are posted as an
    allreduce, or a host lost in FSDP2's gradient reduce-scatter held the survivor 7.5 s
    longer), and the group's next generation is built without waiting for the abandoned
    collective (gloo's destructor would: it joins its threads)."""
    groups = _groups(f"test-silent-{collective}", 2)
    assert [t.item() for t in _in_all(groups, lambda g, r: allreduce(g, r + 1.0))] == [3.0, 3.0]  # connected
    # Rank 1 goes silent: rank 0's next collective has no partner.
    work = _SILENT_PEER[collective](groups[0])
    aborter = threading.Timer(0.3, groups[0].abort, args=("the coordinator announced a failover",))
    started = time.monotonic()
    aborter.start()
    work.wait()
    waited = time.monotonic() - started
    assert "aborted: the coordinator announced a failover" in str(groups[0].errored)
    assert waited < 5.0, f"the aborted {collective} took {waited:.1f} s (gloo's own timeout is 10 s)"
    # The next generation (rank 1: the promoted standby, say) is built while the abandoned
    # collective is still pending in the old one, and works.
    started = time.monotonic()
    _in_all(groups, lambda g, r: g.configure(1))
    assert time.monotonic() - started < 5.0, "the old generation's gloo group held up the new one"
    assert [t.item() for t in _in_all(groups, lambda g, r: allreduce(g, 10.0 * (r + 1)))] == [30.0, 30.0]
    assert all(g.errored is None for g in groups)
    for group in groups:
        group.shutdown()


def test_cpu_reduce_scatters_give_each_rank_its_reduced_chunk():
    """The allreduce that stands for a CPU reduce-scatter gives what gloo's would: rank r holds
    the reduction of chunk r, in both forms (one flat tensor, or a list per output), for sum
    and max, at 3 ranks (so a chunk's place matters)."""
    world = 3
    groups = _groups("test-rs", world)

    def flat(g, r):
        out = torch.empty(2, 3)
        inp = torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3) * (r + 1)
        g._reduce_scatter_base(out, inp, dist.ReduceScatterOptions()).wait()
        return out

    total = sum(torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3) * (r + 1) for r in range(world))
    for rank, out in enumerate(_in_all(groups, flat)):
        assert torch.equal(out, total[2 * rank : 2 * rank + 2]), (rank, out)

    def listed(g, r):
        outs = [torch.empty(2), torch.empty(3)]
        inputs = [
            [torch.full((2,), 10.0 * d + r) for d in range(world)],
            [torch.full((3,), d - r) for d in range(world)],
        ]
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        g.reduce_scatter(outs, inputs, opts).wait()
        return outs

    for rank, (first, second) in enumerate(_in_all(groups, listed)):
        assert torch.equal(first, torch.full((2,), 10.0 * rank + world - 1)), (rank, first)
        assert torch.equal(second, torch.full((3,), float(rank))), (rank, second)
    assert all(g.errored is None for g in groups)
    for group in groups:
        group.shutdown()


def test_device_of_a_collective():
    cpu = torch.zeros(1)
    assert device_type(([cpu], object())) == "cpu"
    assert device_type(([[cpu]],)) == "cpu"
    assert device_type((1, "x")) == ""


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
    monkeypatch.setattr(resilient, "device_type", lambda args: "cuda")  # every collective is a CUDA one
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
