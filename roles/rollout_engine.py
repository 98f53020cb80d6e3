"""The rollout role's serving loop: an engine takes weight versions as they come and serves
the shards of the requests the trainers (and the driver) post.

A request (``replica.roles.rollouts.post_request``) names the weight version it needs; its
prompts are on the engines' desks (``replica.roles.rollout_data``), and its shard k holds
prompts k, k + S, k + 2S, ... (S shards), each generated with seed ``sampling.seed + i``, so a
completion does not depend on which engine made it or on how many are alive. An engine claims
its own shards first (shard k belongs to engine k mod R), then any unclaimed one once its owner
had a moment (``ROLLOUT_STEAL_AFTER``), or one whose claimer died (the coordinator lists dead
members in ``rollout/engine/{i}/dead_since``). It keeps a shard's completions on its own desk
and posts a small signed record of where they are; a request the trainers' leader opened again
(its result's desk was lost before every trainer fetched it) is served again."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import replica
from replica.errors import WeightsTimeoutError
from replica.integrations.vllm.served import ServedLLM
from replica.jobstore import JobStore, Stamp, Text, keys
from replica.jobstore.stores import StoreAddress
from replica.roles import timing
from replica.roles.rollout_data import (
    KEPT_REQUESTS,
    DeskBook,
    decode_tokens,
    encode_tokens,
    kept_blob,
    prompts_blob,
    result_blob,
)
from replica.timing import Deadline, pause
from replica.transport.desk import Desk, blob_digest

if TYPE_CHECKING:
    from vllm import LLM

    from replica.integrations.vllm.worker import EngineWeights

__all__ = ["Engine", "post_result", "serve_requests", "serve_rollouts", "shard_prompts", "superseded"]

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the serving loop needs of an engine: its weights (``update`` applies a version that
    arrived, ``wait`` blocks until ``version`` or a newer one is served and returns it, or raises
    a TimeoutError: ``WeightsTimeoutError``), and generation of a shard's prompts with a seed per prompt.
    ``served_epoch``: (generation, member) of the trainer incarnation that sent the version it serves
    (None: unknown), recorded with each result."""

    @property
    def served_epoch(self) -> tuple[int, int] | None: ...

    def update(self) -> None: ...

    def wait(self, version: int, timeout: timedelta) -> int: ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, seeds: Sequence[int]) -> list[list[int]]: ...

    def close(self) -> None: ...


class _VllmEngine:
    """A vLLM ``LLM`` whose weights replica syncs (``EngineWeights``)."""

    def __init__(self, llm: LLM | ServedLLM, weights: EngineWeights):
        self.llm, self.weights = llm, weights

    @property
    def served_epoch(self) -> tuple[int, int] | None:
        return self.weights.served_epoch

    def update(self) -> None:
        self.weights.update()

    def wait(self, version: int, timeout: timedelta) -> int:
        return self.weights.wait(version, timeout)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, seeds: Sequence[int]) -> list[list[int]]:
        if isinstance(self.llm, ServedLLM):
            return self.llm.complete(
                prompts, temperature=sampling["temperature"], max_tokens=sampling["max_tokens"], seeds=seeds
            )
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=sampling["temperature"],
                max_tokens=sampling["max_tokens"],
                seed=seed,
                detokenize=False,
                ignore_eos=True,
            )
            for seed in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        try:
            self.weights.close()
        finally:
            if isinstance(self.llm, ServedLLM):
                self.llm.close()


def serve_rollouts(
    *,
    store: JobStore,
    index: int,
    num_engines: int,
    token: bytes,
    make_llm: Callable[[], LLM | ServedLLM],
    stop: Callable[[], bool],
    on_shard: Callable[[int], None] | None = None,
    host: str = "127.0.0.1",
    backends: tuple[str, ...] | None = None,
    retiring: Callable[[], bool] | None = None,
) -> None:
    """The rollout role with a vLLM engine: run the one ``make_llm()`` returns (a ``vllm.LLM`` in
    this process, or a ``ServedLLM``: a `vllm serve` beside it), take weight versions as they
    come, serve shards until ``stop()``. ``on_shard(step)`` runs after a shard is claimed and
    before it is generated (fault injection). ``backends``: the engine's receiver's
    ``Config.backends``. A server's workers take the job's token from their own environment."""
    from replica.integrations.vllm.worker import EngineWeights, ReceiverSpec

    llm = make_llm()
    served = isinstance(llm, ServedLLM)
    weights = EngineWeights(
        llm,
        ReceiverSpec(
            index=index,
            store=str(StoreAddress.of(store.raw)),
            token_hex="" if served else token.hex(),
            host=host,
            store_prefix=store.prefix,
            backends=backends,
        ),
    )
    serve_requests(
        store=store,
        index=index,
        num_engines=num_engines,
        token=token,
        engine=_VllmEngine(llm, weights),
        stop=stop,
        on_shard=on_shard,
        host=host,
        retiring=retiring,
    )


def shard_prompts(num_prompts: int, num_shards: int, shard: int) -> range:
    """The prompt indices of a request's shard (prompt i in shard i mod ``num_shards``)."""
    return range(shard, num_prompts, num_shards)


def serve_requests(
    *,
    store: JobStore,
    index: int,
    num_engines: int,
    token: bytes,
    engine: Engine,
    stop: Callable[[], bool],
    on_shard: Callable[[int], None] | None = None,
    host: str = "127.0.0.1",
    retiring: Callable[[], bool] | None = None,
) -> None:
    """Serve requests with ``engine`` (closed on the way out) until ``stop()``: the loop of
    ``serve_rollouts``, for any engine (the tests' and the benchmark's stand-ins too). Stopped
    and ``retiring()`` (the engine is retired, the job goes on), it hands the completions it keeps
    to a live engine first (``_hand_off``): a step redone after the failover that retired it still
    finds them."""
    desk = Desk(token=token, host=host)
    book = DeskBook(store, token=token, num_engines=num_engines)
    try:
        store.put(keys.engine_desk(index), Text(value=desk.address))
        store.put(keys.engine_up(index), Stamp(at=time.time()))
        logger.warning("[rollout %d] engine up, serving (desk %s)", index, desk.address)
        _Server(store, index, num_engines, engine, desk, book, stop, on_shard).run()
        if retiring is not None and retiring():
            _hand_off(store, index, desk, book)
    finally:
        book.close()
        desk.close()
        engine.close()


class _Server:
    """One engine's requests: those posted (in order) and those opened again, each kept until
    nothing of it is left for this engine."""

    def __init__(self, store, index, num_engines, engine, desk, book, stop, on_shard):
        self.store, self.index, self.num_engines = store, index, num_engines
        self.engine, self.desk, self.book, self.stop, self.on_shard = engine, desk, book, stop, on_shard
        self.posted = 0  # requests taken in
        self.reopened = 0  # reopenings taken in
        self.open: dict[int, dict | None] = {}  # request -> its record (None: not read yet)

    def run(self) -> None:
        while not self.stop():
            self._take_in()
            generated = False
            for n in sorted(self.open):
                if self.stop():
                    return
                done, made = self._serve(n)
                generated |= made
                if done:
                    del self.open[n]
            if not generated:
                self.engine.update()  # apply a version as soon as it is complete
                pause(timing.ROLLOUT_POLL)

    def _take_in(self) -> None:
        posted = self.store.count(keys.request_seq())
        for n in range(self.posted + 1, posted + 1):
            self.open.setdefault(n, None)
        if posted > self.posted:  # the window moved: forget what fell out of it (not at every poll)
            self.desk.drop(lambda name: kept_blob(name, posted))
        self.posted = max(self.posted, posted)
        reopened = self.store.count(keys.reopened_seq())
        for m in range(self.reopened + 1, reopened + 1):
            found = self.store.get(keys.reopened(m))
            if found is not None:
                self.open.setdefault(json.loads(found.value)["request"], None)
        self.reopened = max(self.reopened, reopened)
        for n in [n for n in self.open if n <= self.posted - KEPT_REQUESTS]:
            del self.open[n]  # nobody waits for a request this old (and its blobs are dropped)

    def _serve(self, n: int) -> tuple[bool, bool]:
        """Serve a shard of request n if one is free: (nothing of n is left here, a shard was made)."""
        request = self.open[n]
        if request is None:
            text = self.store.get(keys.request(n))
            if text is None:  # numbered, not yet written (or not trustworthy): look again
                return False, False
            request = self.open[n] = json.loads(text.value)
        shards = request["num_shards"]
        if all(self.store.has(keys.result(n, k)) for k in range(shards)):
            return True, False
        prompts = self._prompts(n, request)
        if prompts is None:
            return False, False  # not on any desk yet: the poster's leader uploads it to engines that joined
        shard = _claim(self.store, n, shards, self.index, self.num_engines)
        if shard is None:
            return False, False
        if self.on_shard is not None:
            self.on_shard(request["step"])
        served = _wait_version(self.engine, request["version"], self.stop)
        if served is None:
            return True, False  # told to stop (retired) while waiting: another engine takes the shard
        if superseded(request, served):
            logger.warning(
                "[rollout %d] request %d (step %s) needs version %d, superseded by version %d: its step "
                "was redone after a failover; skipped",
                self.index,
                n,
                request["step"],
                request["version"],
                served,
            )
            return True, False
        index = shard_prompts(request["num_prompts"], shards, shard)
        seeds = [request["sampling"]["seed"] + i for i in index]
        completions = self.engine.generate([prompts[i] for i in index], request["sampling"], seeds)
        post_result(
            self.store,
            self.desk,
            n,
            shard,
            completions,
            engine=self.index,
            version=served,
            epoch=self.engine.served_epoch,
        )
        return False, True

    def _prompts(self, n: int, request: dict) -> list[list[int]] | None:
        """Request n's prompts: from this desk, else from another engine's (kept here then)."""
        name = prompts_blob(n)
        blob = self.desk.get(name)
        if blob is None or blob_digest(blob) != request["prompts"]:
            others = [i for i in range(self.num_engines) if i != self.index]
            blob = self.book.fetch(name, request["prompts"], others)
            if blob is None:
                return None
            self.desk.put(name, blob)
        return decode_tokens(blob)


def post_result(
    store: JobStore,
    desk: Desk,
    n: int,
    shard: int,
    completions: Sequence[Sequence[int]],
    *,
    engine: int,
    version: int,
    epoch: tuple[int, int] | None = None,
) -> None:
    """Keep a shard's completions on this engine's ``desk`` and post where they are (signed,
    with their digest: the readers check it)."""
    blob = encode_tokens(completions)
    desk.put(result_blob(n, shard), blob)
    store.put(
        keys.result(n, shard),
        Text(
            value=json.dumps(
                {
                    "engine": engine,
                    "pid": os.getpid(),
                    "version": version,
                    "epoch": epoch,
                    "digest": blob_digest(blob),
                    "bytes": len(blob),
                    "tokens": sum(map(len, completions)),
                }
            )
        ),
    )


def _hand_off(store: JobStore, index: int, desk: Desk, book: DeskBook) -> None:
    """Put the completions this engine holds on a live engine's desk, and name it in their records."""
    peers = {i: a for i, a in book.addresses().items() if i != index and not _gone(store, i)}
    if not peers:
        return
    target = min(peers)
    moved = 0
    for name in desk.names():
        if not name.startswith("result/"):
            continue
        n, k = (int(part) for part in name.split("/")[1:3])
        current, raw = store.read(keys.result(n, k))
        if current is None:
            continue
        record = json.loads(current.value)
        blob = desk.get(name)  # (None: dropped since it was listed)
        if (
            blob is None
            or record.get("held_by", record["engine"]) != index
            or not book.upload(name, blob, {target: peers[target]})
        ):
            continue
        store.compare_set(keys.result(n, k), raw, Text(value=json.dumps({**record, "held_by": target})))
        moved += 1
    logger.warning("[rollout %d] retired: the completions of %d shard(s) handed to engine %d", index, moved, target)


def superseded(request: dict, served: int) -> bool:
    """Whether ``request`` is obsolete for an engine that serves version ``served`` (>= the
    version it needs: the engine waited for that). Versions are numbered in push order, and
    the trainers push a new one only after they have every completion of their last request
    or gave its step up (a failover: the step is redone with a new push). So a request for
    exactly an older version is finished or abandoned: nobody waits for it, and no engine
    goes back to an older version to serve it. A driver's request (``at_least``) takes any
    newer version."""
    needed = request["version"]
    if served < needed:
        raise replica.ReplicaError(f"an engine serves version {served}, below the {needed} it waited for")
    return served > needed and not request.get("at_least")


def _wait_version(
    engine: Engine, version: int, stop: Callable[[], bool], timeout: timedelta = timing.ROLLOUT_TIMEOUT
) -> int | None:
    """Serve ``version`` once it has arrived; None if told to stop first."""
    deadline = Deadline.after(timeout)
    while not deadline.expired:
        if stop():
            return None
        try:
            return engine.wait(version, timedelta(seconds=0.5))
        except TimeoutError:
            continue
    raise WeightsTimeoutError(f"weights of version {version} did not arrive within {timeout}")


def _claim(store: JobStore, n: int, num_shards: int, index: int, num_engines: int) -> int | None:
    """A shard of request n for this engine to generate, claimed; None if none is free."""
    me = f"{index}:{time.time()!r}"
    shards = range(num_shards)
    mine = [k for k in shards if k % max(num_engines, 1) == index]
    others = [k for k in shards if k not in mine]
    for k in mine + others:
        if store.has(keys.result(n, k)):
            continue
        key = keys.claim(n, k)
        current, raw = store.read(key)
        if current is not None and not _claimer_dead(store, current.value):
            continue
        if current is None and k not in mine and not _gone(store, k % max(num_engines, 1)) and not _waited(store, n):
            continue
        after, _ = store.compare_set(key, raw, Text(value=me))
        if after is not None and after.value == me:
            return k
    return None


def _waited(store: JobStore, n: int) -> bool:
    """Other engines' shards are taken only once they had a moment to claim them."""
    key = keys.request_seen(n)
    seen, raw = store.read(key)
    if seen is None:
        seen, _ = store.compare_set(key, raw, Stamp(at=time.time()))
    return seen is not None and time.time() - seen.at > timing.ROLLOUT_STEAL_AFTER.total_seconds()


def _gone(store: JobStore, engine: int) -> bool:
    """Engine ``engine`` died or was retired and no replacement is up: its shards are free at once."""
    dead = store.get(keys.engine_dead_since(engine))
    if dead is None:
        return False
    up = store.get(keys.engine_up(engine))
    return up is None or dead.at > up.at


def _claimer_dead(store: JobStore, claim: str) -> bool:
    engine, _, at = claim.partition(":")
    dead = store.get(keys.engine_dead_since(int(engine)))
    return dead is not None and dead.at > float(at)
