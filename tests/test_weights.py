"""replica.WeightSync / WeightReceiver: full weights pushed bucket by bucket
from FSDP2 trainers (real gloo, real processes, real UCX) into receivers that
hand engines complete versions only."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import replica
from replica.jobstore import JobStore, keys
from replica.weights import ModelSource, WeightSync, tensor_buckets, weight_layout
from support.weight_engine import EngineStandIn

ROOT = Path(__file__).resolve().parents[1]
TOKEN = b"weights-test-token"
CONFIG = replica.Config(token=TOKEN, bucket_bytes=64 << 10, timeout=timedelta(seconds=20))


def test_buckets_hold_whole_tensors_and_cover_everything():
    named = [
        (f"t{i}", torch.empty(n, dtype=torch.float32, device="meta"))
        for i, n in enumerate([10, 5000, 20000, 3, 70000, 8])
    ]
    layout = weight_layout(named, bucket_bytes=64 << 10)
    buckets = tensor_buckets(layout)
    assert buckets[0].lo == 0 and buckets[-1].hi == layout.total_bytes and buckets[-1].end == len(named)
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.hi == b.lo and a.end == b.first  # contiguous, whole tensors
    for b in buckets:
        assert b.hi - b.lo <= 64 << 10 or b.end - b.first == 1  # only a lone big tensor exceeds the size
    assert [b.end - b.first for b in buckets] == [2, 1, 1, 1, 1]  # t3 and t5 cannot join t4


Engine = functools.partial(EngineStandIn, config=CONFIG, wait=timedelta(seconds=30))


def test_a_held_version_stays_intact_while_newer_ones_arrive():
    """An engine preparing a version holds it; newer versions still complete (the
    sender is not kept waiting for its ack) into a spare buffer, never into the held one."""
    store = dist.HashStore()
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))
    completed: list[int] = []
    engine = Engine(0, store, on_ready=completed.append)
    sync = WeightSync(model, store=store, num_engines=1, config=CONFIG)
    assert sync.push(1).engines_synced == [0]
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    with engine.receiver.hold() as got:
        step, views = got
        held = dict(views)
        for step_pushed in (2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            assert sync.push(step_pushed).engines_synced == [0]  # acknowledged while version 1 is held
        assert step == 1 and completed == [1, 2, 3] and engine.receiver.ready() == 3
        assert all(torch.equal(held[n], first[n]) for n in first)  # untouched by versions 2 and 3
    assert engine.receiver.apply(engine.load) == 3
    assert all(torch.equal(engine.weights[n], p.detach()) for n, p in model.named_parameters())
    with engine.receiver.hold() as got:
        assert got is None  # nothing newer than the served version
    sync.close()
    engine.receiver.close()


def test_in_process_push_resend_skip_and_late_engine():
    store = dist.HashStore()
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))
    engines = [Engine(0, store), Engine(1, store)]
    sync = WeightSync(model, store=store, num_engines=3, config=CONFIG, dtype=torch.bfloat16)
    stats = sync.push(1)
    assert stats.engines_synced == [0, 1] and stats.engines_skipped == {}  # engine 2 never registered
    for e in engines:
        assert e.sync(1) == 1
        assert e.receiver.apply(e.load) is None  # nothing newer
        for name, p in model.named_parameters():
            assert torch.equal(e.weights[name], p.detach().to(torch.bfloat16))
    assert JobStore(store, token=TOKEN).get(keys.engine_version(0)).value == 1

    # A bad link: three buckets corrupted on the way are caught and resent.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sync.faults.corrupt_buckets = 3
    stats = sync.push(2)
    assert sync.faults.corrupted == 3  # the fault fired
    assert stats.resent_buckets == 3 and sum(e.receiver.stats.corrupted_buckets for e in engines) == 3
    for e in engines:
        assert e.sync(2) == 2
        assert all(torch.equal(e.weights[n], p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())

    # Engine 1 dies: the next push skips it; a replacement registered as engine 1 is
    # brought to the current version by refresh() alone, without the trainers.
    engines[1].receiver.close()
    stats = sync.push(3)
    assert stats.engines_synced == [0] and list(stats.engines_skipped) == [1]
    replacement = Engine(1, store)
    assert sync.refresh() == [1]
    assert replacement.sync(3) == 3
    assert all(torch.equal(replacement.weights[n], p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())
    sync.close()
    for e in (engines[0], replacement):
        e.receiver.close()


def test_engine_refuses_weights_that_do_not_fit():
    store = dist.HashStore()

    def expect(layout):
        raise replica.LayoutMismatchError("no parameter named 'x' in the engine")

    engine = Engine(0, store, expect=expect)
    sync = WeightSync(torch.nn.Linear(4, 4), store=store, num_engines=1, config=CONFIG)
    stats = sync.push(1)
    assert stats.engines_synced == [] and engine.receiver.ready() is None
    sync.close()
    engine.receiver.close()
    with pytest.raises(ValueError, match="num_engines"):
        WeightSync(torch.nn.Linear(4, 4), store=store, num_engines=-1, config=CONFIG)


def _trainers(tmp_path: Path, port: int, steps: int, engines: int, **env: str) -> list[subprocess.Popen]:
    script = ROOT / "tests" / "jobs" / "weights_job.py"
    return [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE="2",
                PORT=str(port),
                STEPS=str(steps),
                OUT=str(tmp_path),
                ENGINES=str(engines),
                **env,
            ),
        )
        for r in range(2)
    ]


@pytest.fixture()
def job_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield store


def test_fsdp2_trainers_push_every_step(tmp_path, job_store):
    engine = Engine(0, job_store)
    procs = _trainers(tmp_path, job_store.port, steps=3, engines=1)
    for step in (1, 2, 3):
        assert engine.sync(step) == step
        expected = load_file(str(tmp_path / f"step{step}.safetensors"))
        assert expected.keys() == engine.weights.keys()
        assert all(torch.equal(engine.weights[k], v) for k, v in expected.items())  # the full, unsharded weights
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    engine.receiver.close()


def test_sender_killed_mid_sync_leaves_the_previous_version(tmp_path, job_store):
    engine = Engine(0, job_store)
    procs = _trainers(tmp_path, job_store.port, steps=3, engines=1, WEIGHTS_DIE_AT="2:3")
    assert engine.sync(1) == 1
    assert procs[0].wait(timeout=60) == -9  # the fault fired: rank 0 died packing step 2's fourth bucket
    procs[1].kill()
    procs[1].wait()
    assert not engine.receiver.wait_ready(2, timedelta(seconds=2))  # step 2 never became complete
    assert engine.receiver.apply(engine.load) is None and engine.receiver.version == 1
    expected = load_file(str(tmp_path / "step1.safetensors"))
    assert all(torch.equal(engine.weights[k], v) for k, v in expected.items())  # still all of step 1
    engine.receiver.close()


def test_a_weight_source_is_pushed_in_its_metadatas_order_and_checked():
    """A WeightSource (vLLM's kind: metadata, then full tensors) goes through the same push as
    a model; one that yields another tensor than its metadata names is an error, never a
    version of mixed-up tensors."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 8))
    store = dist.HashStore()
    engine = Engine(0, store)
    sync = WeightSync(ModelSource(model, dtype=torch.bfloat16), store=store, num_engines=1, config=CONFIG)
    assert sync.push(1).engines_synced == [0] and engine.sync(1) == 1
    assert all(torch.equal(engine.weights[n], p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())

    class Reversed(ModelSource):
        def __iter__(self):
            yield from reversed(list(super().__iter__()))

    with pytest.raises(replica.ReplicaError, match="where its metadata has '0.weight'"):
        WeightSync(Reversed(model), store=store, num_engines=1, config=CONFIG).push(2)
    assert engine.receiver.ready() == 1
    engine.receiver.close()


def test_one_receive_buffer_holds_one_version_and_waits_for_its_apply():
    """``WeightReceiver(buffers=1)`` (the vLLM backend's default: live weights plus one copy):
    one buffer of the model's size; a version that starts arriving while the ready one is
    being applied waits for the apply, then displaces it; a push cut short is never applied."""
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 8))
    store = dist.HashStore()
    engine = Engine(0, store, buffers=1)
    sync = WeightSync(model, store=store, num_engines=1, config=CONFIG)
    assert sync.push(1).engines_synced == [0] and engine.sync(1) == 1
    assert engine.receiver._ready is engine.receiver._staging and engine.receiver._spare is None  # one buffer

    bump = lambda: [p.data.add_(1.0) for p in model.parameters()]  # noqa: E731
    bump()
    assert sync.push(2).engines_synced == [0]
    pushed: list[int] = []
    with engine.receiver.hold() as got:  # version 2 is being applied...
        assert got is not None and got[0] == 2
        bump()
        pusher = threading.Thread(target=lambda: pushed.extend(sync.push(3).engines_synced))
        pusher.start()
        pusher.join(timeout=1.0)
        assert pusher.is_alive()  # ...so version 3 waits: the buffer is not overwritten under the apply
        engine.load(got[1])
    engine.receiver.served(2)
    pusher.join(timeout=30)
    assert pushed == [0] and engine.sync(3) == 3
    assert all(torch.equal(engine.weights[n], p.detach()) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="buffers is 1 or 2"):
        Engine(1, store, buffers=3)
    engine.receiver.close()
    sync.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_consumed_version_gives_its_memory_back_as_it_is_copied_out():
    """``hold(consume=True)`` (one buffer): each tensor's pages go back to the OS once the
    loader is done with it, whatever it derived from the view; a view still referenced keeps
    its bytes; the version is not ready after; the next version arrives whole."""
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(24)))  # ~100 MB
    store = dist.HashStore()
    engine = Engine(0, store, buffers=1)
    sync = WeightSync(model, store=store, num_engines=1, config=CONFIG)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        assert sync.push(1).engines_synced == [0] and engine.receiver.wait_ready(1, timedelta(seconds=30))
        start = _rss()
        kept, highest = {}, start
        with engine.receiver.hold(consume=True) as got:
            step, views = got
            for name, view in views:
                engine.weights[name] = view.t().clone()  # a derived view, copied out
                if name == "5.weight":
                    kept[name] = view[::2]  # still referenced when the hold ends
                highest = max(highest, _rss())
        assert step == 1 and engine.receiver.ready() is None  # its bytes are gone
        assert engine.receiver.released_bytes > 0.9 * nbytes
        # The copies took the weights' size; the buffer gave it back as they were made.
        assert highest - start < 0.3 * nbytes and _rss() - start < 0.3 * nbytes, (highest - start, nbytes)
        assert torch.equal(kept["5.weight"], model[5].weight.detach()[::2])  # referenced: intact
        for name, p in model.named_parameters():
            assert torch.equal(engine.weights[name].t(), p.detach()), name
        with torch.no_grad():
            for p in model.parameters():
                p.neg_()
        assert sync.push(2).engines_synced == [0] and engine.sync(2) == 2  # the pages fault back in
        for name, p in model.named_parameters():
            assert torch.equal(engine.weights[name], p.detach()), name
    finally:
        sync.close()
        engine.receiver.close()
    two = Engine(1, store, buffers=2)
    try:
        with (
            pytest.raises(ValueError, match="consume needs a receiver with one buffer"),
            two.receiver.hold(consume=True),
        ):
            pass
    finally:
        two.receiver.close()


def test_host_weights_go_through_shared_memory_offered_where_they_lie():
    """With the shm backend first (trainer and engine on one node), the leader keeps its
    packed version in shared memory: each bucket is offered where it lies (no staging
    copy), the engine copies it out with its digest taken by that copy, and every
    version arrives exact."""
    store = dist.HashStore()
    config = replica.Config(
        token=TOKEN, bucket_bytes=64 << 10, timeout=timedelta(seconds=20), backends=("shm", "ucx", "gloo")
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))
    engine = EngineStandIn(0, store, config=config, wait=timedelta(seconds=30))
    sync = WeightSync(model, store=store, num_engines=1, config=config)
    try:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            assert sync.push(step).engines_synced == [0]
            assert engine.receiver.apply(engine.load) == step
            assert all(torch.equal(engine.weights[n], p.detach()) for n, p in model.named_parameters())
        conn = sync._links[0].conn
        assert engine.receiver.backend == "shm" and conn._host_offers
        assert conn.num_exports == 1 and conn.staged_sends == 0  # the packed version, offered in place
    finally:
        sync.close()
        engine.receiver.close()
