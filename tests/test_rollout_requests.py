"""A driver's rollout request (``request_rollouts``, what ``RayJob.generate`` calls) over a
real job store. The engine's side here is a few lines that answer the request as
``serve_rollouts`` does (a stand-in: a vLLM engine is what the Ray RL test runs, in
``make test-slow``); what is tested is the driver's half of the protocol."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.errors import StoreWaitTimeoutError
from replica.jobstore import JobStore, Number, Text, keys
from replica.roles.rollouts import Sampling, request_rollouts

TOKEN = b"rollout-requests"


@pytest.fixture
def store():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return JobStore(raw, token=TOKEN)


def _answer(store: JobStore, n: int, serves: int) -> None:
    """Engine k answers shard k of request n with version ``serves``: each completion is its
    prompt reversed."""
    own = store.own()
    request = json.loads(own.wait_for(lambda s: s.get(keys.request(n)), wake=lambda: [keys.request(n)],
                                      timeout=timedelta(seconds=20), what="the request").value)
    assert request["at_least"] is True and request["step"] == -1
    for k, shard in enumerate(request["shards"]):
        own.put(keys.result(n, k), Text(value=json.dumps({"engine": k, "pid": 0, "version": serves,
                                                          "completions": [p[::-1] for p in shard]})))


def test_a_driver_request_waits_for_the_first_push_and_gets_completions_in_order(store):
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]

    def trainers_and_engines():
        time.sleep(0.3)
        store.own().put(keys.latest_version(), Number(value=5))  # the trainers' first push
        _answer(store, 1, serves=6)

    helper = threading.Thread(target=trainers_and_engines)
    helper.start()
    got = request_rollouts(store, prompts, Sampling(max_tokens=3), num_shards=3, timeout=timedelta(seconds=20))
    helper.join()
    assert got.completions == [p[::-1] for p in prompts]
    assert got.versions == [6, 6, 6, 6]
    request = json.loads(store.get(keys.request(1)).value)
    assert request["version"] == 5 and request["index"] == [[0, 3], [1], [2]]


def test_a_driver_request_nobody_serves_times_out_naming_it(store):
    store.put(keys.latest_version(), Number(value=1))
    start = time.monotonic()
    with pytest.raises(StoreWaitTimeoutError, match="completions of request 1"):
        request_rollouts(store, [[1]], Sampling(), num_shards=2, timeout=timedelta(seconds=1))
    assert time.monotonic() - start < 5 * 1 + 5


def test_without_a_push_a_driver_request_times_out_naming_the_push(store):
    with pytest.raises(StoreWaitTimeoutError, match="first weight push"):
        request_rollouts(store, [[1]], Sampling(), num_shards=1, timeout=timedelta(seconds=0.5))
    assert store.get(keys.request(1)) is None  # nothing was posted


def test_bad_shard_counts_are_refused(store):
    store.put(keys.latest_version(), Number(value=1))
    with pytest.raises(ValueError, match="num_shards"):
        request_rollouts(store, [[1]], Sampling(), num_shards=0)
    assert request_rollouts(store, [], Sampling(), num_shards=2).completions == []


def test_an_engine_skips_a_request_a_failover_made_obsolete():
    """Request 5 asked for exactly version 4 (step 4, generation 0); trainer 1 died, step 4 was
    redone with version 5, which the engine serves now: request 5 is skipped, never an error
    (seen under load on Ray: every engine died on it, again and again). A driver's request
    takes the newer version; an engine below the version it waited for is a bug."""
    from replica.errors import ReplicaError
    from replica.roles.rollouts import superseded

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
    client = RolloutClient(store=store.own(), sync=_Sync(leader), num_shards=2, epoch=lambda: generation,
                           abort=aborted.is_set, timeout=timedelta(seconds=20))
    client.aborted = aborted
    return client


def _serve_step(store: JobStore, client, step: int, prompts, sampling, *, shards_done: int = 2):
    """``client`` pushes and asks for ``step``'s rollouts; an engine answers ``shards_done`` of
    its 2 shards (fewer: then the step fails, as when a trainer dies meanwhile)."""
    version = client.push(step)
    n = store.count(keys.request_seq()) + 1

    def engine():
        own = store.own()
        request = json.loads(own.wait_for(lambda s: s.get(keys.request(n)), wake=lambda: [keys.request(n)],
                                          timeout=timedelta(seconds=20), what="the request").value)
        for k, shard in enumerate(request["shards"][:shards_done]):
            own.put(keys.result(n, k), Text(value=json.dumps({"engine": 0, "pid": 0, "version": version,
                                                              "completions": [p[::-1] for p in shard]})))
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

    prompts, sampling = [[1, 2], [3, 4, 5], [6]], Sampling(max_tokens=3, seed=4000)
    first = _client(store, 0)
    version = _serve_step(store, first, 4, prompts, sampling)
    assert first.sync.pushed == [version]
    leader, follower = _client(store, 1), _client(store, 1, leader=False)
    answers = {}
    reader = threading.Thread(target=lambda: answers.update(follower=(follower.push(4), follower.generate(
        prompts, sampling, step=4))))
    reader.start()
    assert leader.push(4) == version and leader.sync.pushed == []  # kept: no push
    assert leader.generate(prompts, sampling, step=4) == [p[::-1] for p in prompts]
    reader.join()
    assert answers["follower"] == (version, [p[::-1] for p in prompts]) and follower.sync.pushed == []
    assert store.count(keys.request_seq()) == 1  # nothing asked again
    with pytest.raises(ReplicaError, match="other prompts"):
        leader.generate([[9, 9]] + prompts[1:], sampling, step=4)
    # Step 5, cut short after one shard: the redo waits for the other on the same request.
    five = _serve_step(store, leader, 5, prompts, sampling, shards_done=1)
    again = _client(store, 2)
    assert again.push(5) == five and again.sync.pushed == []
    n = store.count(keys.request_seq())
    store.put(keys.result(n, 1), Text(value=json.dumps({"engine": 1, "pid": 0, "version": five,
                                                         "completions": [prompts[1][::-1]]})))
    assert again.generate(prompts, sampling, step=5) == [p[::-1] for p in prompts]
    assert store.count(keys.request_seq()) == n and regenerated_tokens(served_shards(store)) == 0
    # Step 6, cut short, then a push began (version_seq moved): redone, it pushes and asks again.
    _serve_step(store, again, 6, prompts, sampling, shards_done=1)
    store.count(keys.version_seq(), 1)
    third = _client(store, 3)
    _serve_step(store, third, 6, prompts, sampling)
    assert len(third.sync.pushed) == 1
    assert regenerated_tokens(served_shards(store)) == len(prompts[0]) + len(prompts[2])  # shard 0 made twice
