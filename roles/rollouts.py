"""Rollouts: generation requests from the trainers (and the driver) to the rollout engines.

A request (posted by the trainers' leader rank, ``post_request``) names the weight version it
needs and splits its prompts into *shards*; each shard is generated as one batch with a seed per
prompt by whichever engine claims it (``replica.roles.rollout_engine``), so the completions do
not depend on which engine served them or on how many are alive. The prompts and completions
travel over the engines' desks (``replica.roles.rollout_data``); the job store holds only small
signed records under ``replica.jobstore.keys``' ``rollout/...`` keys: ``seq`` (requests posted),
``req/{n}`` (request n: step, version, sampling, the prompts' digest), ``req/{n}/claim/{k}`` and
``req/{n}/result/{k}`` (which engine holds shard k's completions, their digest and size), none
growing with a step's prompts or tokens. A step redone after a trainer's failover takes the
rollouts its first attempt asked for (``RolloutClient.push``): no second push of the same weights,
no second generation."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TypeVar

import replica
from replica.errors import JobStateError
from replica.jobstore import JobStore, Key, Number, Text, keys
from replica.roles import timing
from replica.roles.rollout_data import DeskBook, decode_tokens, encode_tokens, prompts_blob, result_blob
from replica.timing import Deadline, pause
from replica.transport.desk import blob_digest

__all__ = [
    "KEPT_GENERATIONS",
    "Posted",
    "RolloutClient",
    "Rollouts",
    "Sampling",
    "await_rollouts",
    "fetch_results",
    "post_request",
    "regenerated_tokens",
    "reopen",
    "reopened_tokens",
    "request_rollouts",
    "result_keys",
    "served_shards",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
# A redone step looks this many generations back for its rollouts (failovers in a row before it got there).
KEPT_GENERATIONS = 4
_ENGINES_POLL = timedelta(milliseconds=100)  # the first request's look for engines not up yet


@dataclass(kw_only=True, frozen=True, slots=True)
class Sampling:
    max_tokens: int = 8
    temperature: float = 1.0
    seed: int = 0  # prompt i of a request samples with seed + i


@dataclass(kw_only=True, frozen=True, slots=True)
class Rollouts:
    """A request's completions (token ids, in the prompts' order) and the weight version
    each was generated with."""

    completions: list[list[int]]
    versions: list[int]


class RolloutClient:
    """The trainers' side: push the current weights to every engine, then ask for
    completions made with exactly those weights. Every trainer rank calls both
    (``push`` gathers the parameters collectively); only the leader posts requests, and every
    rank fetches all completions from the engines' desks (``token``: the job's, which they
    check; ``num_engines``: the job's rollout engines)."""

    def __init__(
        self,
        *,
        store: JobStore,
        sync: replica.WeightSync,
        num_shards: int,
        token: bytes,
        num_engines: int,
        epoch: Callable[[], int] = lambda: 0,
        abort: Callable[[], bool] = lambda: False,
        timeout: timedelta = timing.ROLLOUT_TIMEOUT,
    ):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.store = store
        self.sync = sync
        self.num_shards = num_shards
        self.timeout = timeout
        self.version: int | None = None
        self.desks = DeskBook(store, token=token, num_engines=num_engines, timeout=timing.ROLLOUT_DESK_TIMEOUT)
        self._epoch = epoch  # the process-group generation: a redone step is a new exchange
        self._kept: tuple[int, int, dict] | None = None  # (step, n, request n) whose rollouts the redo of step takes
        self._abort = abort  # the step failed (a trainer died): stop waiting, the step is redone
        self._push_s: tuple[int, float] | None = None  # (step, seconds its push took): the report's split
        self._engines_awaited = False  # the first request waited for every engine (_await_engines)

    def push(self, step: int) -> int:
        """Send the current weights as a new version (every rank); returns the version id,
        or -1 if the step was aborted (its outputs are discarded, as a failed step's are).
        A step redone after a failover whose rollouts an earlier generation asked for
        (``_find_kept``) pushes nothing: its rollouts are those, made with the same weights (the
        committed ones: a redo replays bit-identically), and the version is theirs."""
        began = time.perf_counter()
        try:
            return self._push(step)
        finally:
            self._push_s = (step, time.perf_counter() - began)

    def _push(self, step: int) -> int:
        self._kept = None
        plan = keys.kept_request(self._epoch(), step)
        if self.sync.is_leader and not self._abort():  # the leader decides for every rank: push is collective
            self.store.put(plan, Number(value=self._find_kept(step)))
        if not self._wait([plan]):
            return -1
        kept = self._written(plan).value
        if kept >= 0:
            request = json.loads(self._written(keys.request(kept)).value)
            self._kept = (step, kept, request)
            version: int = request["version"]  # the one the kept request was made with
            self.version = version
            if self.sync.is_leader:
                logger.warning(
                    "step %d is redone: its rollouts, request %d (version %d), are kept; no push, and "
                    "only the shards not done yet are generated",
                    step,
                    kept,
                    version,
                )
            return version
        version = self.store.count(keys.version_seq(), 1) if self.sync.is_leader else 0
        self.sync.push(version)
        key = keys.version(self._epoch(), step)
        if self.sync.is_leader and not self._abort():
            self.store.put(key, Number(value=version))
            self.store.put(keys.latest_version(), Number(value=version))
        if not self._wait([key]):
            return -1
        self.version = version = self._written(key).value
        return version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, step: int) -> list[list[int]]:
        """Completions (token ids) of ``prompts`` under the version pushed for ``step``.
        If the step is aborted meanwhile, returns placeholder completions of the right
        size (the step is redone after the failover, and its request is kept: ``push``). A
        redone step whose request was kept gets its completions (waiting for the shards not done
        yet)."""
        began = time.perf_counter()
        completions = self._generate(prompts, sampling, step=step)
        if completions is not None and self.sync.is_leader and not self._abort():
            # The step's rollout time (push and generate), beside which the report sets the step's.
            pushed = self._push_s[1] if self._push_s is not None and self._push_s[0] == step else 0.0
            self.store.put(keys.rollout_seconds(step), Text(value=repr(pushed + time.perf_counter() - began)))
        return completions if completions is not None else [[0] * sampling.max_tokens for _ in prompts]

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, step: int) -> list[list[int]] | None:
        """generate's completions; None when the step was aborted."""
        blob = encode_tokens(prompts)
        posted = None
        if self._kept is not None and self._kept[0] == step:
            _, n, request = self._kept
            self._check_kept(n, request, blob, sampling)
            if self.sync.is_leader:  # an engine that came up since (a replacement) has not got them
                posted = Posted(self.desks, n, blob)
                posted.spread()
        else:
            key = keys.request_of(self._epoch(), step)
            if self.sync.is_leader and self.version is not None and not self._abort():
                self._await_engines()
                posted = post_request(
                    self.store,
                    self.desks,
                    prompts,
                    sampling,
                    step=step,
                    version=self.version,
                    num_shards=self.num_shards,
                    blob=blob,
                )
                self.store.put(key, Number(value=posted.n))
            if not self._wait([key]):
                return None
            n = self._written(key).value
        got = await_rollouts(
            self.store,
            self.desks,
            n,
            len(prompts),
            self.num_shards,
            posted=posted,
            timeout=self.timeout,
            abort=self._abort,
            refresh=self.sync.refresh,
        )
        return None if got is None else got.completions

    def _await_engines(self) -> None:
        """Before the job's first request: every engine it was started with up (its desk
        published), ``ROLLOUT_ENGINES_WAIT`` at most; then on with those up (the others join
        when they come, and take shards from then on)."""
        if self._engines_awaited:
            return
        self._engines_awaited = True
        deadline = Deadline.after(timing.ROLLOUT_ENGINES_WAIT)
        while len(up := self.desks.addresses()) < self.desks.num_engines and not deadline.expired and not self._abort():
            pause(_ENGINES_POLL, deadline=deadline)
        if len(up) < self.desks.num_engines:
            logger.warning(
                "the first request goes to %d of the job's %d engines (the others are not up after %s)",
                len(up),
                self.desks.num_engines,
                timing.ROLLOUT_ENGINES_WAIT,
            )

    def _find_kept(self, step: int) -> int:
        """The newest request for ``step`` of the last KEPT_GENERATIONS generations before this
        one, if the redo can take it: -1 when not. A complete one always (its completions are on
        the engines' desks); one cut short (a trainer died while it was generated) only if no push
        began since its version's: then every engine still holds that version and goes on serving
        the request's missing shards, which the redo waits for (an engine that took a newer version
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
            results = self.store.get_many(result_keys(found.value, request["num_shards"]))
            complete = all(r is not None for r in results)
            return found.value if complete or self.store.count(keys.version_seq()) == request["version"] else -1
        return -1

    def _check_kept(self, n: int, request: dict, blob: bytes, sampling: Sampling) -> None:
        """ReplicaError if kept request ``n`` asked for other prompts or sampling than the redone
        step does (the redo is not the step it replays: loud, as a divergence; nothing is
        generated behind it)."""
        if (
            request["prompts"] != blob_digest(blob)
            or request["num_shards"] != self.num_shards
            or request["sampling"] != asdict(sampling)
        ):
            raise replica.ReplicaError(
                f"step {request['step']} is redone with other prompts or sampling than its kept rollouts (request "
                f"{n}) were made for: the redo diverges from the step it replays (see docs/weight-sync.md)"
            )

    def _written(self, key: Key[T]) -> T:
        """The value under ``key``, which was written (a wait saw it, or the leader found it);
        JobStateError if it is gone or not trustworthy."""
        value = self.store.get(key)
        if value is None:
            raise JobStateError(f"{key} holds no (verified) value")
        return value

    def _wait(self, wanted: list) -> bool:
        """True once every key is set; False if the step was aborted first."""
        try:
            _wait_keys(self.store, wanted, timeout=self.timeout, abort=self._abort)
        except _Aborted:
            return False
        return True

    def close(self) -> None:
        self.desks.close()


class Posted:
    """A request's prompts as its poster holds them, and the desks that have them: ``spread``
    puts them on every engine's desk that has not (an engine that came up since)."""

    def __init__(self, desks: DeskBook, n: int, blob: bytes):
        self.desks, self.n, self.blob = desks, n, blob
        self._held: set[str] = set()

    def spread(self) -> None:
        missing = {i: a for i, a in self.desks.addresses().items() if a not in self._held}
        self._held |= self.desks.upload(prompts_blob(self.n), self.blob, missing)


def post_request(
    store: JobStore,
    desks: DeskBook,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    step: int,
    version: int,
    num_shards: int,
    at_least: bool = False,
    blob: bytes | None = None,
) -> Posted:
    """Post a generation request (prompt i in shard i mod ``num_shards``): its prompts go to
    every engine's desk first (``blob``: them encoded, if the caller has it), then its record to
    the store. ``at_least``: any engine holding ``version`` or a newer one may serve it (a
    driver's request, which does not hold the trainers back); else exactly ``version``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    blob = encode_tokens(prompts) if blob is None else blob
    posted = Posted(desks, store.count(keys.request_seq(), 1), blob)
    posted.spread()
    store.put(
        keys.request(posted.n),
        Text(
            value=json.dumps(
                {
                    "step": step,
                    "version": version,
                    "at_least": at_least,
                    "sampling": asdict(sampling),
                    "num_shards": num_shards,
                    "num_prompts": len(prompts),
                    "prompts": blob_digest(blob),
                    "bytes": len(blob),
                }
            )
        ),
    )
    return posted


def result_keys(n: int, num_shards: int) -> list:
    return [keys.result(n, k) for k in range(num_shards)]


def _wait_keys(
    store: JobStore,
    wanted: list,
    *,
    timeout: timedelta,
    abort: Callable[[], bool],
    refresh: Callable[[], None] | None = None,
    what: str | None = None,
) -> None:
    """Until every key of ``wanted`` holds a (verified) value, polled on this thread's own store
    connection; raises _Aborted once ``abort()`` says so, StoreWaitTimeoutError after ``timeout``.
    ``refresh()`` runs every ``ROLLOUT_REFRESH`` meanwhile."""
    refreshed = Deadline.after(timing.ROLLOUT_REFRESH)

    def check() -> None:
        nonlocal refreshed
        if abort():
            raise _Aborted
        if refresh is not None and refreshed.expired:
            refresh()
            refreshed = Deadline.after(timing.ROLLOUT_REFRESH)

    store.wait_for(
        lambda own: all(v is not None for v in own.get_many(wanted)) or None,
        wake=lambda: wanted,
        timeout=timeout,
        abort=check,
        what=what or f"{wanted[0]} and {len(wanted) - 1} more",
    )


def fetch_results(
    store: JobStore, desks: DeskBook, n: int, num_prompts: int, num_shards: int
) -> tuple[Rollouts, list[int]]:
    """The completions of request ``n`` from the desks their result records name, and the
    shards none of them served (lost: their engine died, or dropped them)."""
    completions: list[list[int]] = [[] for _ in range(num_prompts)]
    versions = [-1] * num_prompts
    lost = []
    records = []
    for k, text in enumerate(store.get_many(result_keys(n, num_shards))):
        if text is None:
            raise replica.ReplicaError(f"request {n}: shard {k} has no (verified) result")
        records.append(json.loads(text.value))
    blobs = desks.fetch_each(
        [(result_blob(n, k), r["digest"], r.get("held_by", r["engine"])) for k, r in enumerate(records)]
    )
    for k, (record, blob) in enumerate(zip(records, blobs, strict=True)):
        if blob is None:
            lost.append(k)
            continue
        for i, tokens in zip(range(k, num_prompts, num_shards), decode_tokens(blob), strict=False):
            completions[i], versions[i] = tokens, record["version"]
    return Rollouts(completions=completions, versions=versions), lost


def reopen(store: JobStore, n: int, shards: Sequence[int]) -> None:
    """Open request ``n``'s ``shards`` again (their completions are on no desk any more): their
    results and claims go, and the engines are told to serve them again."""
    records = [r for r in store.get_many([keys.result(n, k) for k in shards]) if r is not None]
    request = store.get(keys.request(n))
    for k in shards:
        store.delete(keys.result(n, k))
        store.delete(keys.claim(n, k))
    store.put(
        keys.reopened(store.count(keys.reopened_seq(), 1)),
        Text(
            value=json.dumps(
                {
                    "request": n,
                    "step": json.loads(request.value)["step"] if request is not None else -1,
                    "shards": list(shards),
                    "tokens": sum(json.loads(r.value)["tokens"] for r in records),
                }
            )
        ),
    )
    logger.warning(
        "request %d: shard(s) %s are on no engine's desk any more (their engine is gone): generated again",
        n,
        list(shards),
    )


def await_rollouts(
    store: JobStore,
    desks: DeskBook,
    n: int,
    num_prompts: int,
    num_shards: int,
    *,
    posted: Posted | None,
    timeout: timedelta,
    abort: Callable[[], bool] = lambda: False,
    refresh: Callable[[], object] | None = None,
) -> Rollouts | None:
    """Request ``n``'s completions once every shard is done, fetched from the engines' desks;
    None if ``abort()`` said so first. The poster (``posted``: it holds the prompts) spreads them
    to engines that came up meanwhile and opens lost shards again; ``refresh()`` (the leader's
    weight sync) brings a new engine up to date. StoreWaitTimeoutError after ``timeout``."""
    deadline = Deadline.after(timeout)

    def catch_up() -> None:
        if posted is not None:
            posted.spread()
            if refresh is not None:
                refresh()

    wanted = result_keys(n, num_shards)
    while True:
        try:
            _wait_keys(
                store,
                wanted,
                timeout=deadline.remaining(),
                abort=abort,
                refresh=catch_up,
                what=f"the completions of request {n}",
            )
        except _Aborted:
            return None
        got, lost = fetch_results(store, desks, n, num_prompts, num_shards)
        if not lost:
            return got
        if posted is not None:
            reopen(store, n, lost)
        if deadline.expired:
            raise replica.ReplicaError(
                f"request {n}: the completions of shard(s) {lost} were on no engine's desk within {timeout}"
            )
        if abort():
            return None
        pause(timing.ROLLOUT_REFRESH)


def request_rollouts(
    store: JobStore,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    num_shards: int,
    token: bytes,
    num_engines: int,
    timeout: timedelta = timing.ROLLOUT_TIMEOUT,
) -> Rollouts:
    """A driver's request (not a trainer's): completions of ``prompts`` from the rollout
    engines, with the newest weights the trainers have pushed (waits for a first push).
    Each shard is served by one engine with the version it holds then, so shards may
    differ in version while the trainers go on pushing; ``Rollouts.versions`` says which.
    StoreWaitTimeoutError after ``timeout``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not prompts:
        return Rollouts(completions=[], versions=[])
    store = store.own()  # the caller's thread gets its own connection (the driver's coordinator uses its own)
    deadline = Deadline.after(timeout)
    latest = store.wait_for(
        lambda own: own.get(keys.latest_version()),
        wake=lambda: [keys.latest_version()],
        timeout=timeout,
        what="a first weight push of the trainers",
    )
    desks = DeskBook(store, token=token, num_engines=num_engines, timeout=timing.ROLLOUT_DESK_TIMEOUT)
    try:
        posted = post_request(
            store, desks, prompts, sampling, step=-1, version=latest.value, num_shards=num_shards, at_least=True
        )
        got = await_rollouts(
            store, desks, posted.n, len(prompts), num_shards, posted=posted, timeout=deadline.remaining()
        )
        assert got is not None  # None only if abort() said so: nothing aborts a driver's wait
        return got
    finally:
        desks.close()


class _Aborted(Exception):
    """The step failed while a trainer waited for its rollouts (it is redone)."""


def served_shards(store: JobStore) -> list[dict]:
    """Who served each shard of every request, with which weight version (for reports)."""
    rows = []
    for n in range(1, store.count(keys.request_seq()) + 1):
        text = store.get(keys.request(n))
        if text is None:
            continue
        request = json.loads(text.value)
        for k in range(request["num_shards"]):
            result = store.get(keys.result(n, k))
            if result is not None:
                result = json.loads(result.value)
                rows.append(
                    {
                        "request": n,
                        "step": request["step"],
                        "shard": k,
                        "needed": request["version"],
                        "engine": result["engine"],
                        "pid": result["pid"],
                        "version": result["version"],
                        "epoch": result.get("epoch"),
                        "tokens": result["tokens"],
                    }
                )
    return rows


def reopened_tokens(store: JobStore) -> int:
    """The tokens of a trainer step's shards made again after their desk was lost (``reopen``)."""
    found = store.get_many([keys.reopened(m) for m in range(1, store.count(keys.reopened_seq()) + 1)])
    return sum(r["tokens"] for r in (json.loads(f.value) for f in found if f is not None) if r["step"] >= 0)


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
