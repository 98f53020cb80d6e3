"""Mirror integrity: Replicator and Mirror over real UCX and shared memory, in one
process or two (or in two PID namespaces, where shared memory falls back to UCX). Corrupted buckets
are asked for again and never committed; a standby or
trainer dying mid-transfer leaves the last commit intact; mismatched layouts
are refused with the first difference named; exports load back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fsdp_job import JobShape, build_job, train_step

import replica
from replica.errors import LayoutMismatchError, ReplicaError, StandbyLostError
from replica.timing import Deadline
from support.children import spawn, wait_for
from support.state import (
    SHAPE,
    TOKEN,
    T,
    assert_safe_open_reads,
    assert_state_equal,
    config,
    job,
    mirrored,
    state_of,
    trained,
)

SHM = {"backends": ("shm", "ucx", "gloo"), "bucket_bytes": 64 << 10}


UCX = {"backends": ("ucx", "gloo")}


@pytest.fixture(params=["ucx", "shm"])
def via(request) -> dict:
    """The Config options of the backend under test: UCX, or shared memory (the default on
    one node: host buckets offered in place, one copy, the digest in the copy)."""
    return UCX if request.param == "ucx" else SHM


def used_shared_memory(mirror, rep) -> bool:
    """Whether the trainer's stream went over the shm backend, its buckets offered where they lie."""
    conn = rep._stream._conn
    return mirror.backend == "shm" and conn._host_offers and conn.staged_sends == 0 and conn.num_exports > 0


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)  # a free port, no race


def test_commit_then_restore_is_exact(store, via):
    j = job()
    with mirrored(store, j, config(**via)) as (mirror, rep):
        trained(j, 3, rep)
        assert rep.wait_committed() == 3 == rep.last_commit()
        assert used_shared_memory(mirror, rep) == (via is SHM)
        expected, position = state_of(j), j.loader.state_dict()
        fresh = job(seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 3
        assert_state_equal(state_of(fresh), expected)
        assert fresh.loader.state_dict() == position
        assert fresh.scheduler.state_dict() == j.scheduler.state_dict()
        assert mirror.held_steps() in ([2, 3], [3])  # 2 is released once the commit covers 3
        assert rep.stats.wait_s and rep.stats.pack_s
        # Each stream's time is split into its parts (posted, sends finished, answered).
        stream = rep.stream_stats
        assert len(stream.stream_s) == len(stream.post_s) == len(stream.flush_s) == len(stream.reply_s) == 3
        for total, *parts in zip(stream.stream_s, stream.post_s, stream.flush_s, stream.reply_s, strict=False):
            assert all(p >= 0 for p in parts) and abs(sum(parts) - total) < 1e-6


def test_corrupted_buckets_are_sent_again(store, via):
    j = job()
    with mirrored(store, j, config(**via)) as (mirror, rep):
        trained(j, 1, rep)
        rep.wait_committed()
        rep.faults.corrupt_buckets = 3
        trained(j, 1, rep, first=2)
        assert rep.wait_committed() == 2
        assert rep.faults.corrupted == 3  # the fault fired on the wire
        assert mirror.stats.corrupted_buckets == 3  # the standby caught every one
        assert rep.stream_stats.resent_buckets == 3
        fresh = job(seed=5)
        mirror.restore(fresh.model, fresh.optimizer, fresh.extra)
        assert_state_equal(state_of(fresh), state_of(j))


def test_corruption_past_the_resend_limit_is_never_committed(store):
    j = job()
    cfg = config(max_resends=0)
    with mirrored(store, j, cfg) as (mirror, rep):
        trained(j, 2, rep)
        rep.wait_committed()
        at_two = state_of(j)
        rep.faults.corrupt_buckets = 1
        trained(j, 1, rep, first=3)
        with pytest.raises(StandbyLostError, match="still failed their digests"):
            rep.wait_committed(timedelta(seconds=30))
        assert rep.faults.corrupted == 1 and mirror.stats.corrupted_buckets == 1
        assert rep.last_commit() == 2
        assert 3 not in mirror.held_steps()
        with pytest.raises(StandbyLostError):
            rep.commit(4)
        fresh = job(seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 2
        assert_state_equal(state_of(fresh), at_two)
        assert rep.rollback() == 2  # and the trainer's own copy agrees
        assert_state_equal(state_of(j), at_two)


def _standby(pipe, port: int, cfg: replica.Config) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    mirror = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
    pipe.send("ready")
    pipe.recv()  # until killed or told to stop
    mirror.close()


BIG = JobShape(layers=2, dim=256, vocab=1024)  # ~12 MiB of state: a transfer of many buckets


def test_standby_dying_mid_transfer_keeps_the_last_commit(store, via):
    port = store.port
    cfg = config(**{"bucket_bytes": 8 << 10, **via}, num_inflight_buckets=1)
    j = job(BIG)
    with (
        spawn(_standby, port, cfg, name="standby") as standby,
        replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep,
    ):
        assert standby.recv(60) == "ready"
        trained(j, 2, rep)
        assert rep.wait_committed() == 2
        # The standby records its acknowledgement before it replies: freeze it only once the
        # trainer's stream has its reply too, or the stream waits on a frozen peer for step 2.
        deadline = Deadline.after(timedelta(seconds=30))
        while rep.stream_stats.acked_step != 2 and not deadline.expired:
            time.sleep(0.001)
        assert rep.stream_stats.acked_step == 2
        at_two = state_of(j)
        sent = rep.stream_stats.bytes_sent
        standby.freeze()
        trained(j, 1, rep, first=3)
        deadline = Deadline.after(timedelta(seconds=30))
        while rep.stream_stats.bytes_sent == sent and not deadline.expired:
            time.sleep(0.001)
        assert rep.stream_stats.bytes_sent > sent  # step 3 is on its way ...
        standby.kill()  # ... when the standby dies
        assert standby.process.exitcode == -signal.SIGKILL
        with pytest.raises(StandbyLostError, match="unprotected"):
            rep.wait_committed(timedelta(seconds=30))
        assert rep.stream_stats.acked_step == 2
        assert rep.last_commit() == 2
        assert rep.rollback() == 2
        assert_state_equal(state_of(j), at_two)


def _trainer(pipe, port: int, cfg: replica.Config) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    j = job(BIG)
    rep = replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1)
    trained(j, 2, rep)
    rep.wait_committed()
    pipe.send(state_of(j))
    # Tensors cross the pipe as file descriptors fetched from this process: it must live
    # until the test has them (a kill right after the send reset that fetch now and then).
    pipe.recv()
    sent = rep.stream_stats.bytes_sent
    trained(j, 1, rep, first=3)
    while rep.stream_stats.bytes_sent == sent:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-transfer of step 3


def test_trainer_dying_mid_transfer_leaves_the_mirror_on_its_commit(store, via):
    cfg = config(**{"bucket_bytes": 8 << 10, **via}, num_inflight_buckets=1)
    with (
        replica.Mirror(rank=0, world_size=1, store=store, config=cfg) as mirror,
        spawn(_trainer, store.port, cfg, name="trainer") as trainer,
    ):
        at_two = trainer.recv(120)
        trainer.send("go")
        trainer.process.join(60)
        assert trainer.process.exitcode == -signal.SIGKILL
        deadline = Deadline.after(timedelta(seconds=10))
        while mirror.held_steps() != [2] and not deadline.expired:
            time.sleep(0.01)
        assert mirror.held_steps() == [2]  # step 1's version was being overwritten by step 3, never completed
        assert mirror.stats.bytes_received > 0
        fresh = job(BIG, seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 2
        assert_state_equal(state_of(fresh), at_two)


@pytest.fixture
def committed_mirror(store):
    j = job()
    with mirrored(store, j) as (mirror, rep):
        trained(j, 2, rep)
        rep.wait_committed()
        yield mirror, j


def test_restore_refuses_other_shapes(committed_mirror):
    mirror, _ = committed_mirror
    other = job(JobShape(layers=2, dim=32))
    with pytest.raises(LayoutMismatchError, match=r"state tensor 0 differs in shape: model.embed.weight \(256, 32\)"):
        mirror.restore(other.model, other.optimizer, other.extra)


def test_restore_refuses_other_dtypes(committed_mirror):
    mirror, _ = committed_mirror
    other = job()
    other.model.norm.to(torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match="differs in dtype: model.norm.weight"):
        mirror.restore(other.model, other.optimizer, other.extra)


def test_restore_refuses_another_world_size(committed_mirror):
    mirror, _ = committed_mirror
    other = job()
    with pytest.raises(LayoutMismatchError, match="world_size differs: 2 here, 1 in the mirror"):
        mirror.restore(other.model, other.optimizer, other.extra, rank=0, world_size=2)


def test_restore_refuses_other_extras(committed_mirror):
    mirror, _ = committed_mirror
    other = job()
    with pytest.raises(LayoutMismatchError, match="extras differ"):
        mirror.restore(other.model, other.optimizer, {"loader": other.loader})


def test_trainer_of_another_layout_is_refused(committed_mirror, store):
    mirror, _ = committed_mirror
    other = job(JobShape(layers=1))
    with replica.Replicator(
        other.model, other.optimizer, other.extra, store=store, config=config(), rank=0, world_size=1
    ) as rep:
        trained(other, 1, rep, first=10)
        with pytest.raises(LayoutMismatchError, match="refused this trainer's state layout"):
            rep.wait_committed(timedelta(seconds=30))
    assert mirror.held_steps() in ([1, 2], [2])  # nothing of the refused trainer's


def test_export_loads_back(committed_mirror, tmp_path):
    mirror, j = committed_mirror
    path = mirror.export(tmp_path)
    assert path.name == "rank00000.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(path)  # a standard safetensors file
    assert torch.equal(tensors["model.embed.weight"], j.model.embed.weight.detach())
    assert tensors["model.blocks.1.qkv.weight"].dtype == torch.bfloat16
    snapshot = replica.load_export(path)
    assert snapshot.step == 2
    assert_safe_open_reads(path, snapshot)  # every tensor and the metadata, as load_export read them
    fresh = job(seed=5)
    replica.restore_snapshot(snapshot, fresh.model, fresh.optimizer, fresh.extra, rank=0, world_size=1)
    assert_state_equal(state_of(fresh), state_of(j))
    assert snapshot.digests is not None and snapshot.digests == [s for s in mirror._slots if s.step == 2][0].digests

    data = bytearray(path.read_bytes())  # a bit flipped in the file on disk
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(replica.SnapshotCorruptedError, match="step 2"):
        replica.load_export(path)


def test_bad_config_and_arguments(store):
    with pytest.raises(ValueError, match="token"):
        replica.Config(token=b"")
    with pytest.raises(ValueError, match="bucket_bytes"):
        replica.Config(token=TOKEN, bucket_bytes=100)
    with pytest.raises(ValueError, match="timeout"):
        replica.Config(token=TOKEN, timeout=5)
    assert "mirror-unit-token" not in repr(config())
    j = job()
    with pytest.raises(ValueError, match="rank 3 is not in"):
        replica.Replicator(j.model, j.optimizer, store=store, config=config(), rank=3, world_size=2)
    with replica.Replicator(j.model, j.optimizer, store=store, config=config(), rank=0, world_size=1) as rep:
        with pytest.raises(ValueError, match="non-negative int"):
            rep.commit(-1)
        with pytest.raises(ReplicaError, match="before any global commit"):
            rep.rollback()
    with pytest.raises(ValueError, match="unknown transport backend 'carrier-pigeon'"):
        replica.Mirror(rank=0, world_size=1, store=store, config=config(backends=("carrier-pigeon",)))


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.Adam(params, lr=1e-3),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
        lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
    ],
    ids=["adam", "sgd_momentum", "adamw_amsgrad"],
)
def test_other_optimizers_round_trip(store, make_optimizer):
    def make(seed):
        j = job(seed=seed)
        j.optimizer = make_optimizer(j.model.parameters())
        j.scheduler = torch.optim.lr_scheduler.StepLR(j.optimizer, step_size=2)
        return j

    j = make(0)
    with mirrored(store, j) as (mirror, rep):
        trained(j, 3, rep)
        rep.wait_committed()
        fresh = make(7)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra) == 3
        assert_state_equal(state_of(fresh), state_of(j))
        assert len(state_of(j)) > len(list(j.model.parameters()))  # optimizer state is in there
        rng = replica.RNGState().state_dict()  # restored just now; both runs share this process's RNGs
        after = [train_step(j) for _ in range(2)]
        replica.RNGState().load_state_dict(rng)
        again = [train_step(fresh) for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(after, again, strict=False))


def test_fetch_from_the_standby(committed_mirror, store):
    mirror, j = committed_mirror
    snapshot = replica.fetch_mirror(rank=0, world_size=1, store=store, config=config())
    assert snapshot.step == 2
    fresh = job(seed=5)
    replica.restore_snapshot(snapshot, fresh.model, fresh.optimizer, fresh.extra, rank=0, world_size=1)
    assert_state_equal(state_of(fresh), state_of(j))
    with pytest.raises(ReplicaError, match="does not hold step 99"):
        replica.fetch_mirror(rank=0, world_size=1, store=store, config=config(), step=99)
    with pytest.raises(LayoutMismatchError, match="holds a mirror of rank 0/1"):
        replica.fetch_mirror(rank=0, world_size=2, store=store, config=config())


def test_fetch_from_the_standby_over_shared_memory(store):
    """Over the shm backend the standby's versions live in shared memory too: a fetch gets
    them offered where they lie, and restores exactly."""
    from replica.transport import memfd

    j = job()
    cfg = config(**SHM)
    with mirrored(store, j, cfg) as (mirror, rep):
        trained(j, 2, rep)
        rep.wait_committed()
        assert mirror.backend == "shm" and all(memfd.region_of(s.buffer) is not None for s in mirror._slots)
        snapshot = replica.fetch_mirror(rank=0, world_size=1, store=store, config=cfg)
        assert snapshot.step == 2
        fresh = job(seed=5)
        replica.restore_snapshot(snapshot, fresh.model, fresh.optimizer, fresh.extra, rank=0, world_size=1)
        assert_state_equal(state_of(fresh), state_of(j))


_FETCH_FROM_ANOTHER_NAMESPACE = textwrap.dedent("""
    import logging, sys
    from datetime import timedelta
    import torch.distributed as dist
    import replica
    from replica import ops
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    port, token = int(sys.argv[1]), sys.argv[2].encode()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    config = replica.Config(token=token, timeout=timedelta(seconds=30), backends=("shm", "ucx", "gloo"))
    snapshot = replica.fetch_mirror(rank=0, world_size=1, store=store, config=config)
    print(snapshot.step, ops.checksum(snapshot.buffer, 1 << 20).tolist())
""")


@pytest.mark.parametrize("mount_proc", [True, False], ids=["own_proc", "shared_proc"])
def test_a_peer_that_cannot_share_memory_falls_back_to_ucx(store, pid_namespace, mount_proc):
    """A standby on the shm backend also listens on the next backend that fits (UCX). A
    process that cannot map its shared memory (here in a PID namespace of its own, as in
    another container) is refused by shm at the handshake, says so, and fetches over UCX
    the same bytes a process of this namespace gets over shared memory."""
    command = pid_namespace(mount_proc)
    j = job()
    cfg = config(**SHM)
    with mirrored(store, j, cfg) as (mirror, rep):
        trained(j, 2, rep)
        rep.wait_committed()
        assert mirror.backend == "shm" and mirror.fallback is not None and mirror.fallback[0] == "ucx"
        assert mirror._registration.endpoints() == [("shm", mirror.address), mirror.fallback]
        here = replica.fetch_mirror(rank=0, world_size=1, store=store, config=cfg)
        out = subprocess.run(
            [*command, sys.executable, "-c", _FETCH_FROM_ANOTHER_NAMESPACE, str(store.port), TOKEN.decode()],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        assert "cannot share host memory" in out.stderr and "connecting over ucx instead" in out.stderr, out.stderr
        assert out.stdout.split(" ", 1) == ["2", f"{replica.ops.checksum(here.buffer, 1 << 20).tolist()}\n"]


def test_a_fallback_that_cannot_start_leaves_the_listener_on_shared_memory(store, monkeypatch, caplog):
    """A fallback backend that fails to start (UCX without a usable device, say) is logged and
    left out: the standby still serves peers of its memory over shm and registers no fallback."""
    import replica.session.listener
    from replica.errors import TransportError

    real = replica.session.listener.make_backend

    def no_ucx(name, config):
        if name == "ucx":
            raise TransportError("UCX cannot start here (injected)")
        return real(name, config)

    monkeypatch.setattr(replica.session.listener, "make_backend", no_ucx)
    j = job()
    with mirrored(store, j, config(**SHM)) as (mirror, rep):
        assert mirror.backend == "shm" and mirror.fallback is None
        assert mirror._registration.endpoints() == [("shm", mirror.address)]
        assert any("no fallback" in r.getMessage() and "injected" in r.getMessage() for r in caplog.records)
        trained(j, 1, rep)
        assert rep.wait_committed() == 1 and used_shared_memory(mirror, rep)


def test_trainer_reattaches_to_a_replacement_standby(store):
    j = job()
    cfg = config(standby_wait=timedelta(seconds=30))
    first = replica.Mirror(rank=0, world_size=1, store=store, config=cfg)
    replacement = []

    def start_replacement():  # as a launcher would, a moment after the standby died
        time.sleep(0.5)
        replacement.append(replica.Mirror(rank=0, world_size=1, store=store, config=cfg))

    with replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep:
        trained(j, 2, rep)
        rep.wait_committed()
        first.close()  # the standby goes away
        starter = threading.Thread(target=start_replacement)
        starter.start()
        trained(j, 2, rep, first=3)  # commit(4) waits for the replacement to hold step 3
        starter.join()
        second = replacement[0]
        try:
            assert rep.wait_committed() == 4
            assert rep.stream_stats.reattached == 1
            assert second.held_steps() in ([3, 4], [4])
            fresh = job(seed=5)
            second.restore(fresh.model, fresh.optimizer, fresh.extra, step=4)
            assert_state_equal(state_of(fresh), state_of(j))
        finally:
            second.close()


def test_the_next_versions_receives_are_posted_early_only_into_a_slot_nothing_needs(store):
    """Rank 0 of two, rank 1's acknowledgements written to the job store by hand. A
    standby posts the next version's receives before its BEGIN only into a free slot
    or the older version once the global commit covers the newer: while the commit
    lags (rank 1 has not acknowledged), the commit's version is kept."""
    from replica.jobstore import JobStore
    from replica.jobstore.commit import CommitRecord

    record = CommitRecord(JobStore(store, token=TOKEN), world_size=2)
    j = build_job(SHAPE, rank=0, world_size=2, fsdp=False, seed=0)
    cfg = config()
    with (
        replica.Mirror(rank=0, world_size=2, store=store, config=cfg) as mirror,
        replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=2) as rep,
    ):
        trained(j, 1, rep)
        record.acknowledge(1, 1)
        assert rep.wait_committed() == 1
        trained(j, 1, rep, first=2)
        wait_for(lambda: mirror.held_steps() == [1, 2], "the standby to hold step 2")
        time.sleep(0.5)  # many looks at the store meanwhile: the commit is still 1
        assert mirror.held_steps() == [1, 2] and record.last() == 1
        record.acknowledge(1, 2)  # the commit covers step 2: step 1's slot is free for step 3
        wait_for(lambda: mirror.held_steps() == [2], "the standby to release step 1")
        record.acknowledge(1, 3)
        trained(j, 1, rep, first=3)
        assert rep.wait_committed() == 3
        assert mirror.stats.prestaged == 3  # every version landed in receives posted before its BEGIN
        fresh = build_job(SHAPE, rank=0, world_size=2, fsdp=False, seed=5)
        assert mirror.restore(fresh.model, fresh.optimizer, fresh.extra, rank=0, world_size=2) == 3
        assert_state_equal(state_of(fresh), state_of(j))


def test_a_refused_fetch_always_says_why(committed_mirror, store):
    """A standby that does not hold the asked step answers so and hangs up at once; the
    fetcher's receive of that answer is posted before it asks, so the answer arrives
    before the end of the connection however the two race (twenty times; N_REFUSALS=300 under load to stress it)."""
    for _ in range(int(os.environ.get("N_REFUSALS", "20"))):
        with pytest.raises(ReplicaError, match="does not hold step 99"):
            replica.fetch_mirror(rank=0, world_size=1, store=store, config=config(), step=99)
