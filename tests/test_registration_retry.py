"""A registration that could not be reached is tried again (real UCX, in one
process): the trainer waits up to ``standby_wait`` for a standby that registers
late or whose first connection failed, retrying with backoff; weight sync tries
an engine whose connection failed again on a later push instead of never."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import replica
from replica.weights import WeightReceiver, WeightSync
from support.state import assert_state_equal, job, state_of, trained
from support.weight_engine import EngineStandIn

TOKEN = b"registration-retry-token"
T = timedelta(seconds=30)


def config(**kw) -> replica.Config:
    return replica.Config(token=TOKEN, bucket_bytes=16 << 10, commit_timeout=T, **kw)


class DropsFirstSession:
    """Mixed into a listener: its first accepted connection is closed at once (the fault),
    as a handshake cut short by a loaded or restarting peer would be."""

    dropped = 0

    def _session(self, conn) -> None:
        if self.dropped == 0:
            self.dropped += 1
            conn.close()
            return
        super()._session(conn)


class FlakyMirror(DropsFirstSession, replica.Mirror):
    pass


class FlakyReceiver(DropsFirstSession, WeightReceiver):
    pass


def test_a_standby_registering_after_the_timeout_but_within_standby_wait_is_used():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    cfg = config(timeout=timedelta(seconds=2), standby_wait=T)
    j = job()
    late = []

    def register_late():  # well after Config.timeout: it used to fail the first commit
        time.sleep(5)
        late.append(replica.Mirror(rank=0, world_size=1, store=store, config=cfg))

    starter = threading.Thread(target=register_late)
    with replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep:
        began = time.monotonic()
        starter.start()
        trained(j, 1, rep)
        assert rep.wait_committed(timedelta(seconds=60)) == 1
        assert time.monotonic() - began > cfg.timeout.total_seconds()  # it did wait past the timeout
        starter.join()
        mirror = late[0]
        try:
            assert mirror.held_steps() == [1] and rep.stream_stats.reattached == 0
            fresh = job(seed=5)
            mirror.restore(fresh.model, fresh.optimizer, fresh.extra, step=1)
            assert_state_equal(state_of(fresh), state_of(j))
        finally:
            mirror.close()


def test_a_standby_whose_first_connection_failed_is_tried_again():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    cfg = config(timeout=T, standby_wait=timedelta(seconds=20))
    j = job()
    with (
        FlakyMirror(rank=0, world_size=1, store=store, config=cfg) as mirror,
        replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep,
    ):
        trained(j, 2, rep)
        assert rep.wait_committed(timedelta(seconds=60)) == 2
        assert mirror.dropped == 1  # the fault fired
        assert rep.stream_stats.reattached == 1  # the same registration, reached on a later try
        assert mirror.held_steps() in ([1, 2], [2])  # 1 is released once the commit covers 2


def test_an_engine_whose_first_connection_failed_is_synced_on_a_later_push():
    store = dist.HashStore()
    cfg = config(timeout=timedelta(seconds=20))
    engine = EngineStandIn(0, store, config=cfg, wait=T)
    flaky = FlakyReceiver(index=1, store=store, config=cfg)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))
    sync = WeightSync(model, store=store, num_engines=2, config=cfg)
    stats = sync.push(1)
    assert flaky.dropped == 1  # the fault fired
    assert stats.engines_synced == [0] and list(stats.engines_skipped) == [1]
    time.sleep(0.2)  # past the first backoff (50 ms)
    stats = sync.push(2)
    assert stats.engines_synced == [0, 1] and stats.engines_skipped == {}
    assert flaky.wait_ready(2, T) and engine.sync(2) == 2
    sync.close()
    for listener in (engine.receiver, flaky):
        listener.close()
