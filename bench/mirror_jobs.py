"""Mirrored FSDP2 jobs for the benchmarks, driven step by step from the benchmark's process
(tests/support/mirror_roles.py's trainer and standby roles), each process pinned to its cores.

A standby lives on a rollout machine, not beside its trainer: the standbys run on cores of
their own (half of this machine's; the trainers take the other half), so their receive,
digest and flush work does not land on the trainers' cores, while everything the mirror does
in a trainer's process (the pack, the stream thread, UCX's sends) does."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch.distributed as dist
from fsdp_job import JobShape

from support.children import ChildFailed, spawn
from support.mirror_roles import standby_main, trainer_main

__all__ = ["PinnedJob", "SHAPE", "pinned_job", "place", "split_cores"]

# The mirror benchmark's job (bench/test_mirror.py; its snapshot alone: snapshot_pack_run.py).
SHAPE = JobShape(dim=128, layers=4, seq=64, batch=16, samples=4096, total_steps=10_000)


def split_cores() -> tuple[set[int], set[int]]:
    """(the trainers' cores, the standbys' cores): two halves of this process's."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def place(children, cores: set[int]) -> None:
    """Every thread of ``children`` on ``cores`` from now on."""
    for child in children:
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(tid), cores)


def _pinned(pipe, cores: set[int], target, *args) -> None:
    """``target`` on ``cores`` only, every thread it starts included."""
    os.sched_setaffinity(0, cores)
    target(pipe, *args)


class PinnedJob:
    """The children of one job, and its step counter."""

    def __init__(self, trainers, standbys=()):
        self.trainers, self.standbys = trainers, list(standbys)
        self.step = 0

    def run_step(self) -> float:
        """One step on every rank; its seconds (the ranks are in lock step: the slower one)."""
        self.step += 1
        for t in self.trainers:
            t.send("step", self.step, None)
        took = []
        for t in self.trainers:
            kind, at, _, seconds = t.recv(300)
            assert (kind, at) == ("loss", self.step)
            took.append(seconds)
        return max(took)

    def wait_committed(self) -> None:
        for t in self.trainers:
            t.send("wait_committed")
        for t in self.trainers:
            assert t.recv(300) == ("committed", self.step)

    def stats(self) -> dict:
        return self.trainers[0].request("stats", timeout=60)[1]


@contextlib.contextmanager
def pinned_job(stack: contextlib.ExitStack, name: str, world: int, shape: JobShape, config: dict | None):
    """A job of ``world`` trainers; with a ``config`` (``replica.Config``'s arguments), each with
    a standby, mirrored with it. The trainers on one half of the cores, the standbys on the other."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = store.port
    trainer_cores, standby_cores = split_cores()
    standbys = (
        [
            stack.enter_context(
                spawn(_pinned, standby_cores, standby_main, r, world, port, shape, config, name=f"{name}-standby{r}")
            )
            for r in range(world)
        ]
        if config
        else []
    )
    trainers = [
        stack.enter_context(
            spawn(_pinned, trainer_cores, trainer_main, r, world, port, shape, config, name=f"{name}-trainer{r}")
        )
        for r in range(world)
    ]
    for child in standbys + trainers:
        assert child.recv(180)[0] == "ready"
    try:
        yield PinnedJob(trainers, standbys)
    finally:
        for child in trainers + standbys:
            child.send("exit")
        for child in trainers + standbys:  # each says goodbye once closed (its pipe kept open until then)
            with contextlib.suppress(ChildFailed):  # one that failed already: spawn reaps it
                child.recv(60)
        del store
