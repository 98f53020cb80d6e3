"""Spare standbys (``replica launch --spares N``): standby processes started ahead of need,
bound to no rank. A spare runs the job's script up to ``replica.roles.init()`` (the script's
imports, torch's included, the job store's connection) and waits there; when a rank loses its
standby (a promotion, or the standby's death), the launcher binds a ready spare to it instead
of starting a new process, and the spare goes on as that rank's new standby: it builds the
rank's model (the shards a rank holds depend on its rank, so nothing rank-specific can be built
before), publishes its mirror and receives the rank's state. A spare whose job ends unneeded
exits 0.

Two sides: ``wait_for_binding`` (in the spare) and ``SparePool`` (in the launcher or the
coordinator, through its host agents)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

from replica.errors import RoleEnvironmentError
from replica.jobstore import JobStore, Number, Stamp, keys
from replica.roles import timing
from replica.roles.env import RoleEnv
from replica.timing import Deadline

__all__ = ["Replacements", "SpareHost", "SparePool", "wait_for_binding"]

logger = logging.getLogger(__name__)


def wait_for_binding(store: JobStore, env: RoleEnv) -> RoleEnv | None:
    """In spare ``env.spare``: say it is ready, then wait until the launcher binds it to a rank
    (the environment of that rank's standby) or the job ends (None)."""
    index = env.spare
    if index is None:
        raise RoleEnvironmentError(f"{env.role} rank {env.rank} is no spare standby: it has no binding to wait for")
    store.put(keys.spare_ready(index), Stamp(at=time.time()))
    logger.info("[spare %d] ready: waiting to be bound to a rank", index)

    def bound(s: JobStore) -> int | None:
        binding = s.get(keys.spare_binding(index))
        if binding is not None:
            return binding.value
        return -1 if s.has(keys.finished()) else None

    rank = store.wait_for(
        bound,
        wake=lambda: [keys.spare_binding(index)],
        timeout=timing.PROMOTION_WAIT,
        what=f"spare {index}'s rank",
        every=timing.STANDBY_LOOK,
        poll=timing.STANDBY_POLL,
    )
    if rank < 0:
        logger.info("[spare %d] the job ended without needing it", index)
        return None
    logger.warning("[spare %d] bound to rank %d: its new standby", index, rank)
    return dataclasses.replace(env, rank=rank, spare=None)


class Replacements:
    """The new standby or engine processes ``--replacements`` allows an agent to start in all
    (< 0: no limit); a spare's refill is one of them."""

    def __init__(self, allowed: int):
        self.left = allowed

    def take(self) -> bool:
        """One, if any is left."""
        if self.left == 0:
            return False
        self.left -= 1
        return True


class SpareHost(Protocol):
    """Where spares run: ``replica launch``'s ``LocalAgent`` or ``replica coordinator``'s
    ``RemoteAgents`` (each spare placed on a host agent in a failure domain without a trainer)."""

    def start_spare(self, index: int) -> bool:
        """Start spare ``index``; False when nowhere can take it now (asked again later)."""
        ...

    def take_replacement(self) -> bool:
        """One of the new processes ``--replacements`` allows, if any is left."""
        ...

    def spare_of(self, pid: int, host: str | None) -> int | None:
        """The index of the spare that process ``pid`` of ``host`` is, if it is one."""
        ...


class SparePool:
    """The job's spares: ``count`` started through ``host`` (as soon as it can place them),
    bound to ranks that need a standby, each bound one refilled when the replacements allow
    it (a new standby process, taken from those a replacement would take). A spare's exit
    before it is bound is its own business (``exited``), not a member's death."""

    def __init__(self, store: JobStore, count: int, host: SpareHost):
        self._store, self._host = store, host
        self._next = 0
        self._wanted = count  # spares to start still
        self.free: set[int] = set()  # started, not bound yet
        self.bound: list[dict] = []  # rank, spare, at: for the report
        self._retry, self._said = Deadline.now(), False
        self.tick()

    def tick(self) -> None:
        """Start the spares still wanted (a host able to take one may come up later: asked
        again every SPARE_RETRY)."""
        if not self._wanted or not self._retry.expired:
            return
        while self._wanted and self._host.start_spare(self._next):
            self.free.add(self._next)
            self._next, self._wanted = self._next + 1, self._wanted - 1
        if self._wanted:
            self._retry = Deadline.after(timing.SPARE_RETRY)
            if not self._said:
                logger.warning(
                    "%d spare standby(s) cannot be started yet (trainers still joining, or no host "
                    "without a trainer has room): asking again every %g s",
                    self._wanted,
                    timing.SPARE_RETRY.total_seconds(),
                )
                self._said = True

    def exited(self, pid: int, host: str | None = None) -> bool:
        """Whether ``pid`` was a free spare's (then it is out of the pool); a bound spare is its
        rank's standby, whose exit is a member's."""
        index = self._host.spare_of(pid, host)
        # From the store, not ``free``: a coordinator that took the job over started none itself.
        if index is None or self._store.has(keys.spare_binding(index)):
            return False
        self.free.discard(index)
        logger.warning("spare %d (pid %d) exited before it was needed", index, pid)
        return True

    def bind(self, rank: int) -> int | None:
        """Bind a ready spare to ``rank`` (the one started first); its index, or None when none
        is ready. A refill takes its place when allowed."""
        free = sorted(self.free)
        ready = [
            i
            for i, found in zip(free, self._store.get_many([keys.spare_ready(i) for i in free]), strict=False)
            if found is not None
        ]
        if not ready:
            return None
        index = ready[0]
        self.free.discard(index)
        self._store.put(keys.spare_binding(index), Number(value=rank))
        self.bound.append({"rank": rank, "spare": index, "at": time.time()})
        if self._host.take_replacement():
            self._wanted += 1
            self._retry = Deadline.now()
            self.tick()
        return index
