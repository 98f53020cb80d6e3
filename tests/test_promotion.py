"""A promoted standby keeps the commit it was promoted from as its own copy (the
mirror's committed version is handed over, not copied) and sends it to the rank's
new standby before anything newer, so the commit has two copies again: a second
failure right after the first can roll back to it. Real Mirror and Replicator,
real transports, in one process (world size 1)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import replica
from replica.errors import CommitTimeoutError, ReplicaError
from replica.jobstore import JobStore, keys
from support.children import wait_for
from support.state import TOKEN, assert_state_equal, config, job, state_of, trained

T = timedelta(seconds=30)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)


def test_the_promoted_trainer_holds_the_commit_and_its_new_standby_receives_it_first(store):
    cfg = config(standby_wait=T, scrub_interval=timedelta(0))
    j = job()
    standby = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
    with replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep:
        trained(j, 3, rep)
        assert rep.wait_committed() == 3
        wait_for(lambda: rep.stream_stats.acked_step == 3, "the trainer's stream to finish")
    at_commit = state_of(j)  # the trainer is gone: its state lives on in the standby only
    rng = replica.RNGState().state_dict()  # process-wide, so the reference run below puts it back

    # The promotion, as the runtime does it: restore, take both versions over, close the mirror.
    promoted = job(seed=5)
    assert standby.restore(promoted.model, promoted.optimizer, promoted.extra, step=3) == 3
    held, spare = standby.hand_over(3)
    (slot,) = [s for s in standby._slots if s.step == 3]
    assert held is slot and spare is not slot and held.step == 3
    standby.close()
    JobStore.of(store, token=TOKEN).delete(keys.standby(0))  # the coordinator retires its address

    replacement: list[replica.Mirror] = []

    def start_replacement():  # the launcher's new standby, up a moment later
        time.sleep(0.5)
        replacement.append(replica.Mirror(rank=0, world_size=1, store=store, config=cfg))

    starter = threading.Thread(target=start_replacement)
    with replica.Replicator(
        promoted.model, promoted.optimizer, promoted.extra, store=store, config=cfg, rank=0, world_size=1
    ) as rep:
        rep.adopt(held, spare)
        assert rep._snapshots == [held, spare] and spare.step is None  # no copy; the spare holds no step
        assert rep._snapshots[0].buffer.data_ptr() == slot.buffer.data_ptr()
        with pytest.raises(ReplicaError, match="adopt\\(\\) after"):
            rep.adopt(held, spare)
        assert rep.rollback(step=3) == 3  # a second failure now would roll back to its own copy
        assert_state_equal(state_of(promoted), at_commit)
        assert rep.protect()  # no standby holds commit 3 for this rank now: it is queued first
        starter.start()
        # Training goes on meanwhile: step 4 packs into the spare while step 3 waits for the standby.
        trained(promoted, 1, rep, first=4)
        starter.join()
        new_standby = replacement[0]
        try:
            assert rep.wait_committed() == 4
            wait_for(lambda: new_standby.stats.acked[:1] == [3], "the new standby to acknowledge the commit")
            assert new_standby.stats.acked[0] == 3  # the commit first, then the steps after it
            # Step 3 is released once the commit covers 4 (its slot takes step 5 early); step 4,
            # restored exactly, was trained from it.
            assert new_standby.held_steps() in ([3, 4], [4])
            assert not rep.protect()  # it holds the commit now: nothing is sent again
            fresh = job(seed=7)
            new_standby.restore(fresh.model, fresh.optimizer, fresh.extra, step=4)
            assert_state_equal(state_of(fresh), state_of(promoted))
        finally:
            new_standby.close()
    replica.RNGState().load_state_dict(rng)
    trained(j, 1, first=4)  # the run that never failed
    assert_state_equal(state_of(promoted), state_of(j))


def test_a_handed_over_mirror_receives_nothing_more(store):
    cfg = config(scrub_interval=timedelta(0))
    j = job()
    standby = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
    try:
        with replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep:
            trained(j, 2, rep)
            assert rep.wait_committed() == 2
            held, _ = standby.hand_over(2)
            # A zombie of the old trainer streams on: refused, as soon as its stream sees the
            # standby gone (in step 3's commit) or when it waits for the commit.
            with pytest.raises(ReplicaError):
                trained(j, 1, rep, first=3)
                rep.wait_committed(timedelta(seconds=3))
        assert 3 not in standby.held_steps() and held.step == 2  # nothing of step 3 was received
        held.verify()  # and the handed-over version is intact
    finally:
        standby.close()


def test_a_step_answered_but_never_recorded_goes_to_the_replacement(store):
    """A standby answers ACKED before it records the step in the store: one that dies in
    between leaves a step its trainer thinks delivered and no standby records. The
    trainer waiting for that step's global commit sends it to the replacement."""
    cfg = config(standby_wait=T, scrub_interval=timedelta(0))
    j = job()
    standby = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
    record, skipped = standby._acknowledge, []

    def dies_before_recording(begin):  # the fault: step 2 is answered, then the standby is gone
        if begin.step == 2:
            skipped.append(begin.step)
            return
        record(begin)

    standby._acknowledge = dies_before_recording
    new_standby = None
    try:
        with replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep:
            trained(j, 2, rep)
            wait_for(lambda: rep.stream_stats.acked_step == 2, "the answer to step 2")
            # The standby answers first, then records (here: then skips): the answer may arrive first.
            wait_for(lambda: skipped == [2], "the fault: step 2 answered, never recorded", timeout_s=10)
            standby.close()
            # The standby that answered is still the registered one: it may only be slow,
            # so nothing is sent again (the coordinator replaces a dead one).
            with pytest.raises(CommitTimeoutError):
                rep.wait_committed(timedelta(seconds=2.5))
            assert rep.stream_stats.resent_steps == 0 and rep.last_commit() == 1
            new_standby = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
            assert rep.wait_committed() == 2  # sent again to the replacement, which records it
            assert rep.stream_stats.resent_steps == 1
            assert new_standby.held_steps() == [2]
            fresh = job(seed=7)
            new_standby.restore(fresh.model, fresh.optimizer, fresh.extra, step=2)
            assert_state_equal(state_of(fresh), state_of(j))
    finally:
        for m in (standby, new_standby):
            if m is not None:
                m.close()
