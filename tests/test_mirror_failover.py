"""The mirror end to end: 2 FSDP2 trainer ranks (gloo) + 2 standby processes,
real UCX. Trainer 1 is SIGKILLed in the backward of step 7. Its replacement is
either its standby, promoted with the state already in its memory, or a fresh
process that fetches the state from the standby; the survivor rolls back from
its own snapshot (no network); both restart their process group. The per-step
losses of every rank equal a failure-free run bit for bit."""

from __future__ import annotations

import contextlib
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fsdp_job import JobShape

from replica.jobstore import JobStore, keys
from support.children import spawn
from support.mirror_roles import TOKEN, standby_main, trainer_main

SHAPE = JobShape(total_steps=20)
CONFIG = {"bucket_bytes": 64 << 10}  # several buckets per rank
WORLD = 2
KILL_STEP = 7
KILLED_RANK = 1


def _run(*, kill: bool, replace: str = "promote", resilient: bool = False):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    port = store.port
    losses: dict[tuple[int, int], torch.Tensor] = {}
    events: dict[str, object] = {}
    with contextlib.ExitStack() as stack:

        def start(target, rank, name):
            extra = (None, resilient) if target is trainer_main else ()
            return stack.enter_context(spawn(target, rank, WORLD, port, SHAPE, CONFIG, *extra, name=name))

        def ready(*children):
            for child in children:
                assert child.recv(120)[0] == "ready"
            return list(children)

        standbys = ready(*(start(standby_main, r, f"standby{r}") for r in range(WORLD)))
        trainers = ready(*(start(trainer_main, r, f"trainer{r}") for r in range(WORLD)))
        step = 1
        while step <= SHAPE.total_steps:
            die = kill and step == KILL_STEP and not events
            for r, trainer in enumerate(trainers):
                trainer.send("step", step, "backward" if die and r == KILLED_RANK else None)
            if die:
                victim = trainers[KILLED_RANK]
                victim.process.join(60)
                events["exitcode"] = victim.process.exitcode
                events["survivor"] = trainers[1 - KILLED_RANK].recv(60)
                # The commit as the kill left it. The survivor's own commit of the step before may still
                # be in flight (commit() returns before its global commit is recorded): under load it
                # lands after this read, and the job resumes after the commit it rolls back to.
                events["commit_read"] = JobStore(store, token=TOKEN).get(keys.commit()).step
                trainers[1 - KILLED_RANK].send("recover", 1)
                if replace == "promote":  # the standby becomes the trainer; a new standby takes its place
                    (new_standby,) = ready(start(standby_main, KILLED_RANK, "standby1-new"))
                    standbys[KILLED_RANK].send("promote", 1)
                    events["replaced"] = standbys[KILLED_RANK].recv(120)
                    trainers[KILLED_RANK], standbys[KILLED_RANK] = standbys[KILLED_RANK], new_standby
                else:  # a fresh trainer process fetches the state from the standby, which stays its standby
                    trainers[KILLED_RANK] = stack.enter_context(
                        spawn(
                            trainer_main, KILLED_RANK, WORLD, port, SHAPE, CONFIG, 1, resilient, name="trainer1-fresh"
                        )
                    )
                    events["replaced"] = trainers[KILLED_RANK].recv(120)
                events["rolled_back"] = trainers[1 - KILLED_RANK].recv(120)
                events["commit"] = events["rolled_back"][1]
                step = events["commit"] + 1
                continue
            for r, trainer in enumerate(trainers):
                kind, at, loss, _ = trainer.recv(120)
                assert (kind, at) == ("loss", step)
                losses[(r, step)] = loss
            step += 1
        events["final_commit"] = [t.request("wait_committed", timeout=120)[1] for t in trainers]
        for t in trainers + standbys:
            t.send("exit")
    return losses, events


@pytest.fixture(scope="module")
def reference():
    losses, events = _run(kill=False)
    assert events["final_commit"] == [SHAPE.total_steps] * WORLD
    return losses


# `make test` promotes; a fresh replacement (`make test-slow`) is what tests/test_launch.py's
# fault matrix starts after a standby dies.
@pytest.mark.parametrize("replace", ["promote", pytest.param("fresh", marks=pytest.mark.slow)])
def test_failover_losses_are_bit_identical(reference, replace):
    losses, events = _run(kill=True, replace=replace)
    # The fault fired: the trainer died by SIGKILL mid-step, and the survivor noticed.
    assert events["exitcode"] == -signal.SIGKILL
    assert events["survivor"][:2] == ("failed", KILL_STEP) and events["survivor"][3] == "raised"
    commit = events["commit"]
    assert KILL_STEP - 2 <= events["commit_read"] <= commit <= KILL_STEP - 1, events  # the step in flight or one behind
    assert events["replaced"] == ("recovered", commit)
    assert events["rolled_back"] == ("recovered", commit)
    assert events["final_commit"] == [SHAPE.total_steps] * WORLD
    assert set(losses) == set(reference)
    different = [
        (r, s, float(losses[r, s]), float(reference[r, s]))
        for (r, s) in sorted(reference)
        if not torch.equal(losses[r, s], reference[r, s])
    ]
    assert not different, different
    # The run is not trivially constant: losses change from step to step.
    assert len({float(reference[0, s]) for s in range(1, SHAPE.total_steps + 1)}) == SHAPE.total_steps


@pytest.mark.slow  # CI's 30 minutes; every launcher failover in `make test` runs over the resilient group
def test_resilient_group_survivor_keeps_its_module(reference):
    """Over a ResilientProcessGroup the survivor keeps its process group and FSDP2
    module: its errored step finishes without raising, is discarded, the state is
    rolled back in place, and the group re-configured with a fresh rank 1."""
    losses, events = _run(kill=True, replace="fresh", resilient=True)
    assert events["exitcode"] == -signal.SIGKILL
    # The survivor's step finished (no exception through FSDP's hooks); the group recorded the failure.
    assert events["survivor"][:2] == ("failed", KILL_STEP) and events["survivor"][3] == "errored"
    assert events["replaced"] == ("recovered", events["commit"]) == events["rolled_back"]
    assert events["final_commit"] == [SHAPE.total_steps] * WORLD
    different = [(r, s) for (r, s) in sorted(reference) if not torch.equal(losses[r, s], reference[r, s])]
    assert not different, different
