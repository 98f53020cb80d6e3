"""Rollouts: generation requests from the trainers to the rollout engines, and
the rollout role's serving loop.

A request (posted by the trainers' leader rank) names the weight version it
needs and holds its prompts in *shards*; each shard is generated as one batch
with a seed per prompt, by whichever engine claims it, so the completions do
not depend on which engine served them or on how many are alive. An engine
claims its own shards first (shard k belongs to engine k mod R), then any
unclaimed one, or one whose claimer died (the coordinator lists dead members in
``rollout/engine/{i}/dead_since``). The keys are ``replica.jobstore.keys``'
``rollout/...`` ones: ``seq`` (requests posted), ``req/{n}`` (request n, JSON),
``req/{n}/claim/{k}`` and ``req/{n}/result/{k}`` (JSON token ids); every value is signed."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

import replica
from replica.jobstore import JobStore, Number, Stamp, Text, keys
from replica.roles import timing
from replica.timing import Deadline, pause
from replica.jobstore.stores import StoreAddress
from replica.integrations.vllm.worker import EngineWeights, ReceiverSpec

__all__ = ["KEPT_GENERATIONS", "RolloutClient", "Rollouts", "Sampling", "collect_results", "post_request",
           "regenerated_tokens", "request_rollouts", "result_keys", "serve_rollouts", "served_shards", "superseded"]

logger = logging.getLogger(__name__)
# A redone step looks this many generations back for its rollouts (failovers in a row before it got there).
KEPT_GENERATIONS = 4



@dataclass(kw_only=True, frozen=True, slots=True)
class Sampling:
    max_tokens: int = 8
    temperature: float = 1.0
    seed: int = 0  # prompt i of a request samples with seed + i


class RolloutClient:
    """The trainers' side: push the current weights to every engine, then ask for
    completions made with exactly those weights. Every trainer rank calls both
    (``push`` gathers the parameters collectively); only the leader talks to the
    engines, and every rank gets all completions."""

    def __init__(self, *, store: JobStore, sync: replica.WeightSync, num_shards: int,
                 epoch: Callable[[], int] = lambda: 0, abort: Callable[[], bool] = lambda: False,
                 timeout: timedelta = timing.ROLLOUT_TIMEOUT):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.store = store
        self.sync = sync
        self.num_shards = num_shards
        self.timeout = timeout
        self.version: int | None = None
        self._epoch = epoch  # the process-group generation: a redone step is a new exchange
        self._kept: tuple[int, int, dict] | None = None  # (step, n, request n) whose rollouts the redo of step takes
        self._abort = abort  # the step failed (a trainer died): stop waiting, the step is redone

    def push(self, step: int) -> int:
        """Send the current weights as a new version (every rank); returns the version id,
        or -1 if the step was aborted (its outputs are discarded, as a failed step's are).
        A step redone after a failover whose rollouts an earlier generation asked for
        (``_find_kept``) pushes nothing: its rollouts are those, made with the same weights (the
        committed ones: a redo replays bit-identically), and the version is theirs."""
        self._kept = None
        plan = keys.kept_request(self._epoch(), step)
        if self.sync.is_leader and not self._abort():  # the leader decides for every rank: push is collective
            self.store.put(plan, Number(value=self._find_kept(step)))
        if not self._wait([plan]):
            return -1
        kept = self.store.get(plan).value
        if kept >= 0:
            request = json.loads(self.store.get(keys.request(kept)).value)
            self._kept = (step, kept, request)
            self.version = request["version"]
            if self.sync.is_leader:
                logger.warning("step %d is redone: its rollouts, request %d (version %d), are kept; no push, and "
                               "only the shards not done yet are generated", step, kept, self.version)
            return self.version
        version = self.store.count(keys.version_seq(), 1) if self.sync.is_leader else 0
        self.sync.push(version)
        key = keys.version(self._epoch(), step)
        if self.sync.is_leader and not self._abort():
            self.store.put(key, Number(value=version))
            self.store.put(keys.latest_version(), Number(value=version))
        if not self._wait([key]):
            return -1
        self.version = self.store.get(key).value
        return self.version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, step: int) -> list[list[int]]:
        """Completions (token ids) of ``prompts`` under the version pushed for ``step``.
        If the step is aborted meanwhile, returns placeholder completions of the right
        size (the step is redone after the failover, and its request is kept: ``push``). A
        redone step whose request was kept gets its completions (waiting for the shards not done
        yet)."""
        placeholder = [[0] * sampling.max_tokens for _ in prompts]
        if self._kept is not None and self._kept[0] == step:
            _, n, request = self._kept
            self._check_kept(n, request, prompts, sampling)
        else:
            key = keys.request_of(self._epoch(), step)
            if self.sync.is_leader and self.version is not None and not self._abort():
                n = post_request(self.store, prompts, sampling, step=step, version=self.version,
                                 num_shards=self.num_shards)
                self.store.put(key, Number(value=n))
            if not self._wait([key]):
                return placeholder
            n = self.store.get(key).value
        if not self._wait(result_keys(n, self.num_shards), refresh=self.sync.is_leader):
            return placeholder
        return collect_results(self.store, n, len(prompts), self.num_shards).completions

    def _find_kept(self, step: int) -> int:
        """The newest request for ``step`` of the last KEPT_GENERATIONS generations before this
        one, if the redo can take it: -1 when not. A complete one always (its completions are in
        the store); one cut short (a trainer died while it was generated) only if no push began
        since its version's: then every engine still holds that version and goes on serving the
        request's missing shards, which the redo waits for (an engine that took a newer version
        skips an older request: then the step pushes and asks again)."""
        generation = self._epoch()
        earlier = range(generation - 1, max(generation - 1 - KEPT_GENERATIONS, -1), -1)
        for found in self.store.get_many([keys.request_of(g, step) for g in earlier]):
            if found is None:
                continue
            text = self.store.get(keys.request(found.value))
            if text is None:
                return -1
            request = json.loads(text.value)
            results = self.store.get_many(result_keys(found.value, len(request["shards"])))
            complete = all(r is not None for r in results)
            return found.value if complete or self.store.count(keys.version_seq()) == request["version"] else -1
        return -1

    def _check_kept(self, n: int, request: dict, prompts: Sequence[Sequence[int]], sampling: Sampling) -> None:
        """ReplicaError if kept request ``n`` asked for other prompts or sampling than the redone
        step does (the redo is not the step it replays: loud, as a divergence; nothing is
        generated behind it)."""
        if request["shards"] != _shards(prompts, self.num_shards)[1] or request["sampling"] != asdict(sampling):
            raise replica.ReplicaError(
                f"step {request['step']} is redone with other prompts or sampling than its kept rollouts (request "
                f"{n}) were made for: the redo diverges from the step it replays (see docs/weight-sync.md)")

    def _wait(self, wanted: list, *, refresh: bool = False) -> bool:
        """True once every key is set; False if the step was aborted first. Polls the
        keys' existence on this thread's own store connection; ``refresh``: an engine
        that joined meanwhile gets the current version before it serves."""
        refreshed = time.monotonic()

        def abort() -> None:
            nonlocal refreshed
            if self._abort():
                raise _Aborted
            if refresh and time.monotonic() - refreshed > timing.ROLLOUT_REFRESH.total_seconds():
                self.sync.refresh()
                refreshed = time.monotonic()

        try:
            self.store.wait_for(_all_set(wanted), wake=lambda: wanted, timeout=self.timeout, abort=abort,
                                what=f"{wanted[0]} and {len(wanted) - 1} more")
        except _Aborted:
            return False
        return True


@dataclass(kw_only=True, frozen=True, slots=True)
class Rollouts:
    """A request's completions (token ids, in the prompts' order) and the weight version
    each was generated with."""

    completions: list[list[int]]
    versions: list[int]


def post_request(store: JobStore, prompts: Sequence[Sequence[int]], sampling: Sampling, *, step: int,
                 version: int, num_shards: int, at_least: bool = False) -> int:
    """Post a generation request (prompt i in shard i mod ``num_shards``); returns its number.
    ``at_least``: any engine holding ``version`` or a newer one may serve it (a driver's
    request, which does not hold the trainers back); else exactly ``version``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    n = store.count(keys.request_seq(), 1)
    index, shards = _shards(prompts, num_shards)
    store.put(keys.request(n), Text(value=json.dumps({
        "step": step, "version": version, "at_least": at_least, "sampling": asdict(sampling),
        "shards": shards, "index": index})))
    return n


def _shards(prompts: Sequence[Sequence[int]], num_shards: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """A request's shards: the prompt indices of each (prompt i in shard i mod ``num_shards``)
    and their token ids, as the request holds them."""
    index = [list(range(k, len(prompts), num_shards)) for k in range(num_shards)]
    return index, [[[int(t) for t in prompts[i]] for i in shard] for shard in index]


def result_keys(n: int, num_shards: int) -> list:
    return [keys.result(n, k) for k in range(num_shards)]


def _all_set(wanted: list) -> Callable[[JobStore], bool | None]:
    """A ``wait_for`` condition: every key of ``wanted`` holds a (verified) value."""
    return lambda own: all(v is not None for v in own.get_many(wanted)) or None


def collect_results(store: JobStore, n: int, num_prompts: int, num_shards: int) -> Rollouts:
    """The completions of request ``n`` once every shard's result is in the store."""
    completions: list[list[int]] = [[] for _ in range(num_prompts)]
    versions = [-1] * num_prompts
    for k, text in enumerate(store.get_many(result_keys(n, num_shards))):
        if text is None:
            raise replica.ReplicaError(f"request {n}: shard {k} has no (verified) result")
        shard = json.loads(text.value)
        for i, tokens in zip(range(k, num_prompts, num_shards), shard["completions"]):
            completions[i], versions[i] = tokens, shard["version"]
    return Rollouts(completions=completions, versions=versions)


def request_rollouts(store: JobStore, prompts: Sequence[Sequence[int]], sampling: Sampling, *, num_shards: int,
                     timeout: timedelta = timing.ROLLOUT_TIMEOUT) -> Rollouts:
    """A driver's request (not a trainer's): completions of ``prompts`` from the rollout
    engines, with the newest weights the trainers have pushed (waits for a first push).
    Each shard is served by one engine with the version it holds then, so shards may
    differ in version while the trainers go on pushing; ``Rollouts.versions`` says which.
    StoreWaitTimeoutError after ``timeout``."""
    if not prompts:
        return Rollouts(completions=[], versions=[])
    store = store.own()  # the caller's thread gets its own connection (the driver's coordinator uses its own)
    deadline = Deadline.after(timeout)
    latest = store.wait_for(lambda own: own.get(keys.latest_version()), wake=lambda: [keys.latest_version()],
                            timeout=timeout, what="a first weight push of the trainers")
    n = post_request(store, prompts, sampling, step=-1, version=latest.value, num_shards=num_shards, at_least=True)
    wanted = result_keys(n, num_shards)
    store.wait_for(_all_set(wanted), wake=lambda: wanted, timeout=deadline.remaining(),
                   what=f"the completions of request {n}")
    return collect_results(store, n, len(prompts), num_shards)


class _Aborted(Exception):
    """The step failed while a trainer waited for its rollouts (it is redone)."""


def serve_rollouts(*, store: JobStore, index: int, num_engines: int, token: bytes, make_llm: Callable[[], object],
                   stop: Callable[[], bool], on_shard: Callable[[int], None] | None = None,
                   host: str = "127.0.0.1", backends: tuple[str, ...] | None = None) -> None:
    """The rollout role: run an engine, take weight versions as they come, serve
    shards of requests until ``stop()``. ``on_shard(step)`` runs after a shard is
    claimed and before it is generated (fault injection). ``backends``: the engine's
    receiver's ``Config.backends`` (None: the default)."""
    from vllm import SamplingParams

    llm = make_llm()
    weights = EngineWeights(llm, ReceiverSpec(index=index, store=str(StoreAddress.of(store.raw)),
                                              token_hex=token.hex(), host=host, store_prefix=store.prefix,
                                              backends=backends))
    store.put(keys.engine_up(index), Stamp(at=time.time()))
    seen = 0  # requests fully handled here
    logger.warning("[rollout %d] engine up, serving", index)
    while not stop():
        posted = store.count(keys.request_seq())
        if seen >= posted:
            weights.update()  # apply a version as soon as it is complete
            pause(timing.ROLLOUT_POLL)
            continue
        n = seen + 1
        text = store.get(keys.request(n))
        if text is None:  # numbered, not yet written (or not trustworthy): look again
            pause(timing.ROLLOUT_POLL)
            continue
        request = json.loads(text.value)
        shard = _claim(store, n, request, index, num_engines)
        if shard is None:
            if all(store.has(keys.result(n, k)) for k in range(len(request["shards"]))):
                seen = n
            else:
                pause(timing.ROLLOUT_POLL)
            continue
        if on_shard is not None:
            on_shard(request["step"])
        served = _wait_version(weights, request["version"], stop)
        if served is None:
            break  # told to stop (retired) while waiting: another engine takes the shard
        if superseded(request, served):
            logger.warning("[rollout %d] request %d (step %s) needs version %d, superseded by version %d: its step "
                           "was redone after a failover; skipped", index, n, request["step"], request["version"],
                           served)
            seen = n
            continue
        sampling = request["sampling"]
        params = [SamplingParams(temperature=sampling["temperature"], max_tokens=sampling["max_tokens"],
                                 seed=sampling["seed"] + i, detokenize=False, ignore_eos=True)
                  for i in request["index"][shard]]
        outs = llm.generate([{"prompt_token_ids": p} for p in request["shards"][shard]], params, use_tqdm=False)
        store.put(keys.result(n, shard), Text(value=json.dumps({
            "engine": index, "pid": os.getpid(), "version": served, "epoch": weights.served_epoch,
            "completions": [list(o.outputs[0].token_ids) for o in outs]})))
    weights.close()


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


def _wait_version(weights: EngineWeights, version: int, stop: Callable[[], bool],
                  timeout: timedelta = timing.ROLLOUT_TIMEOUT) -> int | None:
    """Serve ``version`` once it has arrived; None if told to stop first."""
    deadline = Deadline.after(timeout)
    while not deadline.expired:
        if stop():
            return None
        try:
            return weights.wait(version, timedelta(seconds=0.5))
        except TimeoutError:
            continue
    raise TimeoutError(f"weights of version {version} did not arrive within {timeout}")


def _claim(store: JobStore, n: int, request: dict, index: int, num_engines: int) -> int | None:
    """A shard of request n for this engine to generate, claimed; None if none is free."""
    me = f"{index}:{time.time()!r}"
    shards = range(len(request["shards"]))
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


def served_shards(store: JobStore) -> list[dict]:
    """Who served each shard of every request, with which weight version (for reports)."""
    rows = []
    for n in range(1, store.count(keys.request_seq()) + 1):
        text = store.get(keys.request(n))
        if text is None:
            continue
        request = json.loads(text.value)
        for k in range(len(request["shards"])):
            result = store.get(keys.result(n, k))
            if result is not None:
                result = json.loads(result.value)
                rows.append({"request": n, "step": request["step"], "shard": k, "needed": request["version"],
                             "engine": result["engine"], "pid": result["pid"], "version": result["version"],
                             "epoch": result.get("epoch"), "tokens": sum(map(len, result["completions"]))})
    return rows


def regenerated_tokens(rows: list[dict]) -> int:
    """Of ``served_shards``' rows, the tokens of a trainer step's shard generated more than once
    (in a second request for the same step: a redone step that asked again)."""
    seen: set[tuple[int, int]] = set()
    again = 0
    for row in rows:
        if row["step"] < 0:
            continue  # a driver's request: no step of the trainers'
        if (row["step"], row["shard"]) in seen:
            again += row["tokens"]
        seen.add((row["step"], row["shard"]))
    return again
