"""Digests at rest: every held version keeps the digests its buckets were sent
with, and nothing that changed in memory since is used. A byte flipped in a
standby's committed version is refused by restore, export and fetch, and found
by the scrub, which gets the bucket from the trainer again; a byte flipped in a
trainer's own snapshot is refused by rollback. Every test first checks that its
flip really changed what the digest sees."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import replica
from replica.errors import SnapshotCorruptedError
from replica.state.export import load_export, write_export
from replica.state.snapshot import Snapshot, bucket_digests
from replica.transport.base import bucket_digest
from support.children import spawn, wait_for
from support.state import assert_safe_open_reads, assert_state_equal, config, job, mirrored, state_of, trained

T = timedelta(seconds=30)
NO_SCRUB = timedelta(0)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)


def flip(snapshot: Snapshot, bucket: int = 1) -> None:
    """Flip one bit in the middle of ``bucket``, as a memory error would."""
    assert snapshot.digests is not None, "the version holds no digests to check against"
    lo, hi = snapshot.layout.buckets()[bucket]
    assert bucket_digests(snapshot.buffer, [(lo, hi)])[0] == snapshot.digests[bucket]  # intact before
    snapshot.buffer[(lo + hi) // 2] ^= 0x10
    assert bucket_digests(snapshot.buffer, [(lo, hi)])[0] != snapshot.digests[bucket]  # the flip fired
    assert snapshot.bad_buckets() == [bucket]


def committed_slot(mirror: replica.Mirror, step: int) -> Snapshot:
    (slot,) = [s for s in mirror._slots if s.step == step]
    return slot


def commit_steps(j, rep: replica.Replicator, steps: int) -> None:
    trained(j, steps, rep)
    assert rep.wait_committed() == steps
    # The trainer keeps its digests before it reads the standby's reply: wait for that reply.
    wait_for(lambda: rep.stream_stats.acked_step == steps, "the trainer's stream to finish")


def test_digests_are_the_wire_digests_and_capture_drops_them():
    layout = replica.StateLayout.of(
        job().model, None, world_size=1, rank=0, extras_capacity=1 << 10, bucket_bytes=4 << 10
    )
    snapshot = Snapshot(layout)
    snapshot.buffer.copy_(torch.randint(0, 256, snapshot.buffer.shape, dtype=torch.uint8))
    ranges = layout.buckets()
    assert len(ranges) > 2
    # A bucket's digest keys its words from its offset: the same as its block of the whole buffer.
    assert snapshot.compute_digests() == [bucket_digest(snapshot.buffer[lo:hi], offset=lo) for lo, hi in ranges]
    assert snapshot.compute_digests() == bucket_digests(snapshot.buffer, ranges)
    snapshot.verify()  # no digests: nothing to check
    snapshot.digests = snapshot.compute_digests()
    snapshot.step = 7
    snapshot.verify()
    flip(snapshot, bucket=2)
    with pytest.raises(SnapshotCorruptedError, match=r"step 7.*bucket\(s\) \[2\]") as caught:
        snapshot.verify()
    assert (caught.value.rank, caught.value.step, caught.value.buckets) == (0, 7, (2,))
    j = job()
    tensors = [t for _, t in replica.state.layout.state_tensors(j.model, None)]
    snapshot.capture(tensors, b"", step=8)
    assert snapshot.digests is None  # they described the content the capture replaced
    # A capture asked for digests takes them while it packs (ops.pack_checksum), extras included.
    snapshot.capture(tensors, b"some extras", step=9, digests=True)
    assert snapshot.digests == snapshot.compute_digests()
    assert snapshot.extras() == b"some extras"


def test_scrub_interval_is_validated():
    assert replica.Config(token=b"t").scrub_interval == timedelta(seconds=60)
    replica.Config(token=b"t", scrub_interval=timedelta(0))  # disables the scrub
    with pytest.raises(ValueError, match="scrub_interval"):
        replica.Config(token=b"t", scrub_interval=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="scrub_interval"):
        replica.Config(token=b"t", scrub_interval=5)


def test_a_flip_in_the_standby_is_refused_by_restore_export_and_fetch(store, tmp_path):
    j = job()
    cfg = config(scrub_interval=NO_SCRUB)
    with mirrored(store, j, cfg) as (mirror, rep):
        commit_steps(j, rep, 3)
        slot = committed_slot(mirror, 3)
        (trainer_copy,) = [s for s in rep._snapshots if s.step == 3]
        assert slot.digests == trainer_copy.digests  # both ends keep the digests the stream carried
        fetched = replica.fetch_mirror(rank=0, world_size=1, store=store, config=cfg)
        assert fetched.step == 3 and fetched.digests == slot.digests
        fetched.verify()

        flip(slot)
        fresh = job(seed=5)
        before = state_of(fresh)
        with pytest.raises(SnapshotCorruptedError, match=r"rank 0.*step 3.*\[1\]") as caught:
            mirror.restore(fresh.model, fresh.optimizer, fresh.extra)
        assert (caught.value.rank, caught.value.step, caught.value.buckets) == (0, 3, (1,))
        assert_state_equal(state_of(fresh), before)  # nothing of it was written
        with pytest.raises(SnapshotCorruptedError, match="step 3"):
            mirror.export(tmp_path)
        assert not list(tmp_path.iterdir())
        with pytest.raises(SnapshotCorruptedError, match=r"rank 0.*step 3.*\[1\]") as caught:
            replica.fetch_mirror(rank=0, world_size=1, store=store, config=cfg)
        assert (caught.value.step, caught.value.buckets) == (3, (1,))
        # (Step 2 is not there to fall back to: the commit covers 3, so its slot was
        # released for step 4's receives. A damaged commit is repaired from the trainer.)
        wait_for(lambda: mirror.held_steps() == [3], "step 2's slot to be released")
        assert mirror.stats.scrub_passes == 0  # refused by the checks before use, not by a scrub


def test_a_flip_in_the_trainers_snapshot_is_refused_by_rollback(store):
    j = job()
    with mirrored(store, j, config(scrub_interval=NO_SCRUB)) as (mirror, rep):
        commit_steps(j, rep, 2)
        train_step_state = state_of(j)
        (own,) = [s for s in rep._snapshots if s.step == 2]
        flip(own, bucket=0)
        with pytest.raises(SnapshotCorruptedError, match=r"rank 0.*step 2.*\[0\]") as caught:
            rep.rollback()
        assert (caught.value.rank, caught.value.step, caught.value.buckets) == (0, 2, (0,))
        assert_state_equal(state_of(j), train_step_state)  # nothing restored
        # The standby's copy of the same commit is intact.
        fresh = job(seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 2
        assert_state_equal(state_of(fresh), train_step_state)


def _flip_past_the_blob(snapshot: Snapshot) -> int:
    """Flip a bit in the last byte of the extras region (past the blob, where the capture
    left zeros and the pack read nothing); returns its bucket, checked to fail its digest."""
    at = snapshot.layout.extras_offset + snapshot.layout.extras_capacity - 1
    assert at >= snapshot.layout.extras_offset + 8 + len(snapshot.extras()) and int(snapshot.buffer[at]) == 0
    (bucket,) = [i for i, (lo, hi) in enumerate(snapshot.layout.buckets()) if lo <= at < hi]
    lo, hi = snapshot.layout.buckets()[bucket]
    snapshot.buffer[at] ^= 0x10
    assert bucket_digests(snapshot.buffer, [(lo, hi)])[0] != snapshot.digests[bucket]  # the flip fired
    return bucket


def test_a_flip_in_the_zeros_past_the_extras_is_mended(store, caplog):
    """The trainer's pack does not read its extras region past the blob: the capture left
    zeros there, and the digests say so. A flip there (between two captures into the same
    buffer, which does not rewrite it) holds no state: rollback zeroes it again and restores,
    and a stream whose standby keeps refusing that bucket mends it and streams again."""
    j = job()
    cfg = config(scrub_interval=NO_SCRUB, max_resends=1, standby_wait=timedelta(seconds=20))
    with mirrored(store, j, cfg) as (mirror, rep):
        commit_steps(j, rep, 2)
        at_two = state_of(j)
        (own,) = [s for s in rep._snapshots if s.step == 2]
        bucket = _flip_past_the_blob(own)
        with caplog.at_level("WARNING", logger="replica.state.snapshot"):
            assert rep.rollback() == 2
        assert f"bucket(s) [{bucket}]" in caplog.text and "zeroed again" in caplog.text
        assert own.bad_buckets() == []
        assert_state_equal(state_of(j), at_two)
        # The next commit packs into the other buffer (step 1's), past whose blob the flip now is.
        (older,) = [s for s in rep._snapshots if s.step == 1]
        _flip_past_the_blob(older)
        refused = mirror.stats.corrupted_buckets
        trained(j, 1, rep, first=3)
        assert rep.wait_committed(T) == 3
        wait_for(lambda: rep.stream_stats.acked_step == 3, "the trainer's stream to finish")
        assert mirror.stats.corrupted_buckets - refused == 2  # the first send and the one resend
        assert rep.stream_stats.reattached == 1  # streamed again, mended
        at_three = state_of(j)
        fresh = job(seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 3
        assert_state_equal(state_of(fresh), at_three)


def test_without_verify_no_digests_are_kept(store):
    j = job()
    with mirrored(store, j, config(verify=False)) as (mirror, rep):
        commit_steps(j, rep, 2)
        assert committed_slot(mirror, 2).digests is None
        assert all(s.digests is None for s in rep._snapshots)
        assert rep.rollback() == 2


def _trainer(pipe, port: int, cfg: replica.Config) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    j = job()
    rep = replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1)
    commit_steps(j, rep, 3)
    pipe.send(("committed", state_of(j)))
    pipe.recv()  # the test flipped a bit in its standby: the trainer serves the repair meanwhile
    pipe.send(("repaired", rep.stream_stats.repaired_buckets))
    pipe.recv()
    rep.close()


def test_the_scrub_finds_a_flip_and_the_trainer_repairs_it(store):
    cfg = config(scrub_interval=timedelta(seconds=0.2))
    with (
        replica.Mirror(rank=0, world_size=1, store=store, config=cfg) as mirror,
        spawn(_trainer, store.port, cfg, name="trainer") as trainer,
    ):
        kind, at_three = trainer.recv(120)
        assert kind == "committed"
        slot = committed_slot(mirror, 3)
        kept = list(slot.digests)
        wait_for(lambda: mirror.stats.scrub_passes >= 1, "a clean scrub pass")
        assert mirror.stats.scrub_failures == 0
        with mirror._cond:  # not mid-bucket of a scrub pass
            flip(slot, bucket=1)
        wait_for(lambda: mirror.stats.scrub_failures >= 1, "the scrub to find the flip")
        wait_for(lambda: mirror.stats.repaired_buckets >= 1, "the repair")
        assert mirror.stats.scrub_failures == 1 and mirror.stats.repaired_buckets == 1
        assert slot.step == 3 and slot.digests == kept and slot.bad_buckets() == []
        assert not mirror._damaged
        assert trainer.request("repairs?", timeout=60) == ("repaired", 1)  # the trainer sent it, once
        fresh = job(seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 3
        assert_state_equal(state_of(fresh), at_three)
        trainer.send("exit")


def test_a_flip_with_no_trainer_to_repair_it_stays_refused(store):
    cfg = config(scrub_interval=timedelta(seconds=0.2))
    with replica.Mirror(rank=0, world_size=1, store=store, config=cfg) as mirror:
        with spawn(_trainer, store.port, cfg, name="trainer") as trainer:
            assert trainer.recv(120)[0] == "committed"
            trainer.kill()
        wait_for(lambda: mirror._trainer is None or not mirror._trainer.alive, "the standby to see the trainer gone")
        slot = committed_slot(mirror, 3)
        with mirror._cond:
            flip(slot, bucket=0)
        wait_for(lambda: mirror.stats.scrub_failures >= 1, "the scrub to find the flip")
        assert mirror.stats.repaired_buckets == 0
        fresh = job(seed=5)
        with pytest.raises(SnapshotCorruptedError, match=r"step 3.*\[0\]"):
            mirror.restore(fresh.model, fresh.optimizer, fresh.extra)


def _rewrite_metadata(path, change) -> None:
    """Rewrite the metadata of an export: the same tensors, the metadata ``change`` made."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    change(meta)
    save_file(load_file(path), path, metadata=meta)


def test_an_export_written_before_offset_keyed_digests_is_still_checked(tmp_path):
    """Exports of protocol 1 kept digests keyed from each bucket's start: load_export checks
    those, then keeps the offset-keyed ones; a changed byte is refused either way."""
    j = job()
    layout = replica.StateLayout.of(j.model, None, world_size=1, rank=0, extras_capacity=1 << 10, bucket_bytes=4 << 10)
    snapshot = Snapshot(layout)
    tensors = [t for _, t in replica.state.layout.state_tensors(j.model, None)]
    snapshot.capture(tensors, b"extras", step=5, digests=True)
    path = write_export(snapshot, tmp_path / "rank0.safetensors")
    old = [bucket_digest(snapshot.buffer[lo:hi]) for lo, hi in layout.buckets()]
    assert old != snapshot.digests  # the two keyings differ: the test can tell them apart

    def to_protocol_1(meta):
        del meta["replica.digests_keyed"]
        meta["replica.digests"] = json.dumps(old)

    _rewrite_metadata(path, to_protocol_1)
    loaded = load_export(path)
    assert loaded.digests == snapshot.digests and torch.equal(loaded.buffer, snapshot.buffer)
    assert_safe_open_reads(path, loaded)

    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a byte of the body (of the last tensor safetensors wrote: every byte is in a bucket)
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptedError, match="changed since the file was written"):
        load_export(path)
