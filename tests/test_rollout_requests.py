"""Rollout requests over a real job store and real desks: a driver's (``request_rollouts``,
what ``RayJob.generate`` calls) and the trainers' (``RolloutClient``). The engines here are
stand-ins (``support.rollouts``: each completion made from its prompt and seed, or a
few lines that answer as the serving loop does), run through the real serving loop where a
test says so; a vLLM engine is what the RL tests run."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.errors import StoreWaitTimeoutError
from replica.jobstore import JobStore, Number, Text, keys
from replica.roles.rollout_data import DeskBook, decode_tokens, encode_tokens, prompts_blob
from replica.roles.rollout_engine import post_result, serve_requests, shard_prompts
from replica.roles.rollouts import Sampling, fetch_results, request_rollouts
from replica.transport.desk import Desk, blob_digest
from support.rollouts import StandInEngine, largest_store_value, stand_in_completion

TOKEN = b"rollout-requests"


@pytest.fixture
def store():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return JobStore(raw, token=TOKEN)


@contextlib.contextmanager
def _desks(store: JobStore, count: int):
    """``count`` engines' desks, published as the serving loop publishes them."""
    desks = [Desk(token=TOKEN) for _ in range(count)]
    for i, desk in enumerate(desks):
        store.put(keys.engine_desk(i), Text(value=desk.address))
    try:
        yield desks
    finally:
        for desk in desks:
            desk.close()


def _answer(store: JobStore, desks: list[Desk], n: int, serves: int, *, shards: range | None = None) -> dict:
    """Engine k answers shard k of request n with version ``serves`` (engine 0 all of them with
    one desk): each completion is its prompt reversed, from the prompts the poster put on the desk."""
    own = store.own()
    request = json.loads(
        own.wait_for(
            lambda s: s.get(keys.request(n)),
            wake=lambda: [keys.request(n)],
            timeout=timedelta(seconds=20),
            what="the request",
        ).value
    )
    for k in shards if shards is not None else range(request["num_shards"]):
        desk = desks[k % len(desks)]
        blob = desk.get(prompts_blob(n))
        assert blob is not None and blob_digest(blob) == request["prompts"]
        prompts = decode_tokens(blob)
        post_result(
            own,
            desk,
            n,
            k,
            [prompts[i][::-1] for i in shard_prompts(request["num_prompts"], request["num_shards"], k)],
            engine=k % len(desks),
            version=serves,
        )
    return request


def test_a_driver_request_waits_for_the_first_push_and_gets_completions_in_order(store):
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]
    answered = {}

    with _desks(store, 3) as desks:

        def trainers_and_engines():
            time.sleep(0.3)
            store.own().put(keys.latest_version(), Number(value=5))  # the trainers' first push
            answered.update(_answer(store, desks, 1, serves=6))

        helper = threading.Thread(target=trainers_and_engines)
        helper.start()
        got = request_rollouts(
            store,
            prompts,
            Sampling(max_tokens=3),
            num_shards=3,
            token=TOKEN,
            num_engines=3,
            timeout=timedelta(seconds=20),
        )
        helper.join()
    assert got.completions == [p[::-1] for p in prompts]
    assert got.versions == [6, 6, 6, 6]
    assert answered["version"] == 5 and answered["at_least"] is True and answered["step"] == -1
    assert answered["num_shards"] == 3 and answered["num_prompts"] == 4
    assert answered["prompts"] == blob_digest(encode_tokens(prompts))  # the record names the prompts, holds none


def test_a_driver_request_nobody_serves_times_out_naming_it(store):
    store.put(keys.latest_version(), Number(value=1))
    start = time.monotonic()
    with pytest.raises(StoreWaitTimeoutError, match="completions of request 1"):
        request_rollouts(
            store, [[1]], Sampling(), num_shards=2, token=TOKEN, num_engines=2, timeout=timedelta(seconds=1)
        )
    assert time.monotonic() - start < 5 * 1 + 5


def test_without_a_push_a_driver_request_times_out_naming_the_push(store):
    with pytest.raises(StoreWaitTimeoutError, match="first weight push"):
        request_rollouts(
            store, [[1]], Sampling(), num_shards=1, token=TOKEN, num_engines=1, timeout=timedelta(seconds=0.5)
        )
    assert store.get(keys.request(1)) is None  # nothing was posted


def test_bad_shard_counts_are_refused(store):
    store.put(keys.latest_version(), Number(value=1))
    with pytest.raises(ValueError, match="num_shards"):
        request_rollouts(store, [[1]], Sampling(), num_shards=0, token=TOKEN, num_engines=1)
    assert request_rollouts(store, [], Sampling(), num_shards=2, token=TOKEN, num_engines=1).completions == []


def test_an_engine_skips_a_request_a_failover_made_obsolete():
    """Request 5 asked for exactly version 4 (step 4, generation 0); trainer 1 died, step 4 was
    redone with version 5, which the engine serves now: request 5 is skipped, never an error
    (seen under load on Ray: every engine died on it, again and again). A driver's request
    takes the newer version; an engine below the version it waited for is a bug."""
    from replica.errors import ReplicaError
    from replica.roles.rollout_engine import superseded

    assert superseded({"version": 4, "step": 4}, 5)
    assert not superseded({"version": 5, "step": 4}, 5)
    assert not superseded({"version": 4, "step": -1, "at_least": True}, 5)
    with pytest.raises(ReplicaError, match="below"):
        superseded({"version": 6, "step": 5}, 5)


class _Sync:
    """Stands in for ``replica.WeightSync`` (whose engines are vLLM's: the RL tests run those):
    counts the pushes a trainer rank makes."""

    def __init__(self, leader: bool):
        self.is_leader, self.pushed = leader, []

    def push(self, version: int) -> None:
        self.pushed.append(version)

    def refresh(self) -> None:
        pass


def _client(store: JobStore, generation: int, *, leader: bool = True):
    from replica.roles.rollouts import RolloutClient

    aborted = threading.Event()  # set: the step failed (a trainer died), as the runtime says
    client = RolloutClient(
        store=store.own(),
        sync=_Sync(leader),
        num_shards=2,
        token=TOKEN,
        num_engines=1,
        epoch=lambda: generation,
        abort=aborted.is_set,
        timeout=timedelta(seconds=20),
    )
    client.aborted = aborted
    return client


def _serve_step(store: JobStore, desks, client, step: int, prompts, sampling, *, shards_done: int = 2):
    """``client`` pushes and asks for ``step``'s rollouts; an engine answers ``shards_done`` of
    its 2 shards (fewer: then the step fails, as when a trainer dies meanwhile)."""
    version = client.push(step)
    n = store.count(keys.request_seq()) + 1

    def engine():
        _answer(store, desks, n, version, shards=range(shards_done))
        if shards_done < 2:
            client.aborted.set()

    answer = threading.Thread(target=engine)
    answer.start()
    got = client.generate(prompts, sampling, step=step)
    answer.join()
    assert got == ([p[::-1] for p in prompts] if shards_done == 2 else [[0] * sampling.max_tokens] * len(prompts))
    return version


def test_a_redone_step_takes_the_rollouts_its_first_attempt_asked_for(store):
    """Step 4's rollouts were done in generation 0 when a trainer died; redone in generation 1,
    the step pushes nothing and generates nothing: it gets the same completions, every rank
    (the leader decides, a follower reads its word). Step 5's request was cut short (one shard
    of two done): redone, it pushes nothing and waits for the missing shard only, which the
    engines, still at its version, go on serving. Step 6's was cut short and a push began after
    it (a zombie's): redone, it pushes and asks again. A redo asking for other prompts is
    refused loudly."""
    from replica.errors import ReplicaError
    from replica.roles.rollouts import regenerated_tokens, served_shards

    with _desks(store, 1) as desks:
        prompts, sampling = [[1, 2], [3, 4, 5], [6]], Sampling(max_tokens=3, seed=4000)
        first = _client(store, 0)
        version = _serve_step(store, desks, first, 4, prompts, sampling)
        assert first.sync.pushed == [version]
        leader, follower = _client(store, 1), _client(store, 1, leader=False)
        answers = {}
        reader = threading.Thread(
            target=lambda: answers.update(follower=(follower.push(4), follower.generate(prompts, sampling, step=4)))
        )
        reader.start()
        assert leader.push(4) == version and leader.sync.pushed == []  # kept: no push
        assert leader.generate(prompts, sampling, step=4) == [p[::-1] for p in prompts]
        reader.join()
        assert answers["follower"] == (version, [p[::-1] for p in prompts]) and follower.sync.pushed == []
        assert store.count(keys.request_seq()) == 1  # nothing asked again
        with pytest.raises(ReplicaError, match="other prompts"):
            leader.generate([[9, 9]] + prompts[1:], sampling, step=4)
        # Step 5, cut short after one shard: the redo waits for the other on the same request.
        five = _serve_step(store, desks, leader, 5, prompts, sampling, shards_done=1)
        again = _client(store, 2)
        assert again.push(5) == five and again.sync.pushed == []
        n = store.count(keys.request_seq())
        _answer(store, desks, n, five, shards=range(1, 2))
        assert again.generate(prompts, sampling, step=5) == [p[::-1] for p in prompts]
        assert store.count(keys.request_seq()) == n and regenerated_tokens(served_shards(store)) == 0
        # Step 6, cut short, then a push began (version_seq moved): redone, it pushes and asks again.
        _serve_step(store, desks, again, 6, prompts, sampling, shards_done=1)
        store.count(keys.version_seq(), 1)
        third = _client(store, 3)
        _serve_step(store, desks, third, 6, prompts, sampling)
        assert len(third.sync.pushed) == 1
        assert regenerated_tokens(served_shards(store)) == len(prompts[0]) + len(prompts[2])  # shard 0 made twice


def _serve(store: JobStore, **kwargs) -> None:
    serve_requests(store=store.own(), **kwargs)  # the engine's thread, its own store connection


@contextlib.contextmanager
def _serving(store: JobStore, engines: list, *, per_engine=lambda i: {}, **kwargs):
    """Engine i of ``engines`` on the real serving loop, each in a thread of its own; yields
    each loop's (stop event, thread); every loop is stopped and joined on the way out.
    ``kwargs`` go to every loop, ``per_engine(i)``'s to loop i."""
    stops = [threading.Event() for _ in engines]
    loops = [
        threading.Thread(
            target=_serve,
            args=(store,),
            kwargs=dict(
                index=i,
                num_engines=len(engines),
                token=TOKEN,
                engine=engine,
                stop=stops[i].is_set,
                **kwargs,
                **per_engine(i),
            ),
        )
        for i, engine in enumerate(engines)
    ]
    for loop in loops:
        loop.start()
    try:
        yield list(zip(stops, loops, strict=False))
    finally:
        for stop in stops:
            stop.set()
        for loop in loops:
            loop.join(20)


def test_completions_lost_with_their_engine_are_made_again_by_another(store):
    """Two stand-in engines (said so: no model) on the real serving loop; engine 0 serves shard
    0 and dies (its loop ends, its desk closes, the coordinator marks it dead) before the driver
    fetched it: the driver opens the shard again and engine 1 makes it, the same completions
    (seeded per prompt)."""
    from replica.jobstore import Stamp

    prompts, sampling = [[i, i + 1] for i in range(6)], Sampling(max_tokens=5, seed=7)
    engines = [StandInEngine(version=1), StandInEngine(version=1)]
    gate = threading.Event()

    def hold(step: int) -> None:  # engine 1 waits until engine 0 made shard 0 and died
        gate.wait(20)

    result = {}
    try:
        with _serving(store, engines, per_engine=lambda i: {"on_shard": hold if i == 1 else None}) as loops:
            store.put(keys.latest_version(), Number(value=1))
            asker = threading.Thread(
                target=lambda: result.update(
                    got=request_rollouts(
                        store,
                        prompts,
                        sampling,
                        num_shards=2,
                        token=TOKEN,
                        num_engines=2,
                        timeout=timedelta(seconds=60),
                    )
                )
            )
            asker.start()
            store.wait_for(
                lambda s: s.get(keys.result(1, 0)),
                wake=lambda: [keys.result(1, 0)],
                timeout=timedelta(seconds=20),
                what="shard 0",
            )
            (stop, loop), _ = loops
            stop.set()
            loop.join(20)
            store.put(keys.engine_dead_since(0), Stamp(at=time.time()))
            gate.set()
            asker.join(60)
    finally:
        gate.set()
    want = [stand_in_completion(p, sampling.seed + i, sampling.max_tokens) for i, p in enumerate(prompts)]
    assert result["got"].completions == want
    from replica.roles.rollouts import reopened_tokens

    reopening = json.loads(store.get(keys.reopened(1)).value)
    assert store.count(keys.reopened_seq()) == 1 and reopening["request"] == 1  # the fault fired
    assert reopening["shards"] == [0] and reopening["tokens"] == 3 * 5 and reopening["step"] == -1
    assert reopened_tokens(store) == 0  # a driver's request: no trainer step made twice
    assert engines[0].generated == 3 * 5 and engines[1].generated == 6 * 5  # shard 1, then shard 0 again


def test_a_large_request_keeps_every_store_value_small(store):
    """1,024 prompts x 256 tokens (a 1 MiB prompt blob, 1 MiB of completions) through two
    stand-in engines (no model): the store's largest value stays far under 64 KiB."""
    prompts = [[(i * 13 + j) % 32_000 for j in range(256)] for i in range(1024)]
    sampling = Sampling(max_tokens=256, seed=3)
    with largest_store_value() as largest, _serving(store, [StandInEngine(version=2), StandInEngine(version=2)]):
        store.put(keys.latest_version(), Number(value=2))
        got = request_rollouts(
            store, prompts, sampling, num_shards=2, token=TOKEN, num_engines=2, timeout=timedelta(seconds=60)
        )
    assert got.completions == [stand_in_completion(p, 3 + i, 256) for i, p in enumerate(prompts)]
    assert got.versions == [2] * 1024
    assert 0 < largest[0] < 4096, largest[0]


def test_a_retired_engine_hands_its_completions_to_a_live_one(store):
    """Two stand-in engines (no model) serve a request; engine 1 is then retired (stopped,
    ``retiring``): before it closes its desk it puts its shard's completions on engine 0's and
    names it in the record, so the request is fetched whole afterwards, nothing made again."""
    prompts, sampling = [[i, 2 * i] for i in range(4)], Sampling(max_tokens=4, seed=1)
    engines = [StandInEngine(version=1), StandInEngine(version=1)]
    with _serving(store, engines, retiring=lambda: True) as loops:
        store.put(keys.latest_version(), Number(value=1))
        first = request_rollouts(
            store, prompts, sampling, num_shards=2, token=TOKEN, num_engines=2, timeout=timedelta(seconds=30)
        )
        _, (stop, loop) = loops
        stop.set()
        loop.join(20)
        assert json.loads(store.get(keys.result(1, 1)).value)["held_by"] == 0  # handed on
        book = DeskBook(store, token=TOKEN, num_engines=2)
        again, lost = fetch_results(store, book, 1, len(prompts), 2)
        book.close()
    assert lost == [] and again.completions == first.completions
    assert engines[0].generated + engines[1].generated == 4 * 4  # each shard made once
    assert store.count(keys.reopened_seq()) == 0
