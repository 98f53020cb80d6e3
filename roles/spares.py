"""Spare standbys (``replica launch --spares N``): standby processes started ahead of need,
bound to no rank. A spare runs the job's script up to ``replica.roles.init()`` (the script's
imports, torch's included, the job store's connection) and waits there; when a rank loses its
standby (a promotion, or the standby's death), the launcher binds a ready spare to it instead
of starting a new process, and the spare goes on as that rank's new standby: it builds the
rank's model (the shards a rank holds depend on its rank, so nothing rank-specific can be built
before), publishes its mirror and receives the rank's state. A spare whose job ends unneeded
exits 0.

Two sides: ``wait_for_binding`` (in the spare) and ``SparePool`` (in the launcher)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from replica.jobstore import JobStore, Number, Stamp, keys
from replica.roles import timing
from replica.roles.env import RoleEnv

__all__ = ["SparePool", "wait_for_binding"]

logger = logging.getLogger(__name__)


def wait_for_binding(store: JobStore, env: RoleEnv) -> RoleEnv | None:
    """In spare ``env.spare``: say it is ready, then wait until the launcher binds it to a rank
    (the environment of that rank's standby) or the job ends (None)."""
    index = env.spare
    store.put(keys.spare_ready(index), Stamp(at=time.time()))
    logger.info("[spare %d] ready: waiting to be bound to a rank", index)

    def bound(s: JobStore) -> int | None:
        binding = s.get(keys.spare_binding(index))
        if binding is not None:
            return binding.value
        return -1 if s.has(keys.finished()) else None

    rank = store.wait_for(bound, wake=lambda: [keys.spare_binding(index)], timeout=timing.PROMOTION_WAIT,
                          what=f"spare {index}'s rank", every=timing.STANDBY_LOOK, poll=timing.STANDBY_POLL)
    if rank < 0:
        logger.info("[spare %d] the job ended without needing it", index)
        return None
    logger.warning("[spare %d] bound to rank %d: its new standby", index, rank)
    return dataclasses.replace(env, rank=rank, spare=None)


class SparePool:
    """The launcher's spares: started through ``start(index) -> pid``, bound to ranks that need
    a standby, each bound one refilled when ``refill()`` allows it (a new standby process, taken
    from the replacements a replacement would take). A spare's exit before it is bound is its
    own business (``exited``), not a member's death."""

    def __init__(self, store: JobStore, count: int, *, start: Callable[[int], int], refill: Callable[[], bool]):
        self._store, self._start, self._refill = store, start, refill
        self._next = 0
        self.free: dict[int, int] = {}  # index -> pid, not bound yet
        self.bound: list[dict] = []  # rank, spare, at: for the report
        for _ in range(count):
            self._spawn()

    def _spawn(self) -> None:
        index, self._next = self._next, self._next + 1
        self.free[index] = self._start(index)

    def exited(self, pid: int) -> bool:
        """Whether ``pid`` was a free spare's (then it is out of the pool)."""
        for index, spare_pid in list(self.free.items()):
            if spare_pid == pid:
                del self.free[index]
                logger.warning("spare %d (pid %d) exited before it was needed", index, pid)
                return True
        return False

    def bind(self, rank: int) -> int | None:
        """Bind a ready spare to ``rank`` (the one ready longest); its index, or None when none
        is ready. A refill takes its place when allowed."""
        ready = [i for i, found in zip(self.free, self._store.get_many([keys.spare_ready(i) for i in self.free]))
                 if found is not None]
        if not ready:
            return None
        index = ready[0]
        del self.free[index]
        self._store.put(keys.spare_binding(index), Number(value=rank))
        self.bound.append({"rank": rank, "spare": index, "at": time.time()})
        if self._refill():
            self._spawn()
        return index
