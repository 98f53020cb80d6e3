"""Epoch fencing of weight sync (real UCX, in one process): an engine's receiver
accepts only the current epoch of the trainers' leader rank, as the coordinator's
signed generation record names it. A zombie leader (declared dead, still running)
is refused at its next version and at every connection after; a legitimate leader
that races a generation change is refused for one push, never crashes, and is
synced again once its epoch is current."""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import replica
from replica.jobstore import Epoch, Generation, JobStore, keys
from replica.weights import WeightSync
from support.weight_engine import EngineStandIn

TOKEN = b"weight-fencing-token"
CONFIG = replica.Config(token=TOKEN, bucket_bytes=64 << 10, timeout=timedelta(seconds=20))
Engine = functools.partial(EngineStandIn, config=CONFIG, wait=timedelta(seconds=30))


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))


def bump(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)


def holds(engine: EngineStandIn, m: torch.nn.Module) -> bool:
    return all(torch.equal(engine.weights[n], p.detach()) for n, p in m.named_parameters())


def synced_once(epoch):
    """Generation 0 with trainers (1, 2); one engine; a leader of ``epoch()`` that pushed version 1."""
    store = dist.HashStore()
    jobs = JobStore(store, token=TOKEN)
    jobs.put(keys.generation(), Generation(number=0, trainers=(1, 2)))
    engine = Engine(0, store)
    trained = model()
    sync = WeightSync(trained, store=store, num_engines=1, config=CONFIG, epoch=epoch)
    assert sync.push(1).engines_synced == [0] and engine.sync(1) == 1  # its epoch is current: accepted
    return store, jobs, engine, trained, sync


def test_an_engine_refuses_a_superseded_leader_and_accepts_the_current_one():
    store, jobs, engine, trained, zombie = synced_once(lambda: Epoch(generation=0, member=1))

    # Trainer 1 (the leader, rank 0) is declared dead while still running; member 7 holds rank 0 now.
    jobs.put(keys.generation(), Generation(number=1, trainers=(7, 2)))
    bump(trained)
    stats = zombie.push(2)  # on its open connection: refused at the version's BEGIN
    assert stats.engines_synced == [] and list(stats.engines_skipped) == [0]
    assert engine.receiver.stats.fenced == 1  # the fault fired and the engine saw it
    stats = zombie.push(3)  # connecting afresh: refused before it can displace anyone, and says so
    assert stats.engines_synced == [] and "refused epoch 0/1" in stats.engines_skipped[0]
    assert engine.receiver.stats.fenced == 2
    assert zombie.refresh() == [] and engine.receiver.stats.fenced == 2  # within its backoff: not even tried
    time.sleep(0.2)  # past the first backoff (50 ms)
    assert zombie.refresh() == [] and engine.receiver.stats.fenced == 3  # tried again, never let in
    assert not engine.receiver.wait_ready(2, timedelta(seconds=1))
    assert engine.receiver.ready() == 1 and engine.receiver.apply(engine.load) is None  # still version 1

    current = WeightSync(
        trained, store=store, num_engines=1, config=CONFIG, epoch=lambda: Epoch(generation=1, member=7)
    )
    stats = current.push(4)
    assert stats.engines_synced == [0] and stats.engines_skipped == {}
    assert engine.sync(4) == 4 and holds(engine, trained)
    assert zombie.push(5).engines_synced == [] and engine.receiver.ready() == 4  # it took nobody's place
    for s in (zombie, current):
        s.close()
    engine.receiver.close()


def test_a_leader_racing_a_generation_change_is_skipped_once_then_synced():
    generation = [0]  # the leader's own generation, as its process group knows it
    _, jobs, engine, trained, sync = synced_once(lambda: Epoch(generation=generation[0], member=1))

    # Rank 1 fails over (member 5): the leader moves to generation 1 with the job and goes on
    # pushing on the same connection.
    jobs.put(keys.generation(), Generation(number=1, trainers=(1, 5)))
    generation[0] = 1
    bump(trained)
    assert sync.push(2).engines_synced == [0] and engine.sync(2) == 2 and holds(engine, trained)

    # Another failover is announced before the leader has moved: its push is refused, it does
    # not crash, and the engine keeps version 2.
    jobs.put(keys.generation(), Generation(number=2, trainers=(1, 6)))
    bump(trained)
    stats = sync.push(3)
    assert stats.engines_synced == [] and list(stats.engines_skipped) == [0]
    assert engine.receiver.stats.fenced == 1 and engine.receiver.ready() == 2
    stats = sync.push(4)  # still behind: refused at the connection this time, skipped again
    assert stats.engines_synced == [] and "refused epoch 1/1" in stats.engines_skipped[0]
    assert engine.receiver.stats.fenced == 2
    generation[0] = 2  # the leader catches up: the very next push reaches the engine again, backoff or not
    bump(trained)
    stats = sync.push(5)
    assert stats.engines_synced == [0] and stats.engines_skipped == {}
    assert engine.sync(5) == 5 and holds(engine, trained)
    sync.close()
    engine.receiver.close()


def test_without_a_generation_record_every_epoch_is_accepted():
    store = dist.HashStore()
    engine = Engine(0, store)
    trained = model()
    sync = WeightSync(trained, store=store, num_engines=1, config=CONFIG, epoch=lambda: Epoch(generation=3, member=9))
    assert sync.push(1).engines_synced == [0] and engine.sync(1) == 1 and holds(engine, trained)
    assert engine.receiver.stats.fenced == 0
    sync.close()
    engine.receiver.close()
