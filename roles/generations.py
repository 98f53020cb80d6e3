"""The coordinator's generations: the number of the current one and its record, published
whole (every rank's trainer) with its number after it, guarded against a writer that is not
this coordinator, read back by a coordinator elected after another died, and renewed after a
step failed with no death (a regroup)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from replica.errors import JobStateError
from replica.jobstore import Failover as FailoverRecord
from replica.jobstore import Generation, JobStore, keys
from replica.jobstore.commit import publish_generation
from replica.roles import timing
from replica.roles.env import Role
from replica.roles.members import Member, Members
from replica.roles.timing import Deadlines

__all__ = ["Generations"]

logger = logging.getLogger(__name__)


class Generations:
    """Owns the generation number (``number``: 0, then one more per failover or regroup), its
    record in the store (``keys.generation()``: the number and each rank's live trainer, the
    epochs receivers accept) and the regroups so far (``regroups``, for the report).

    Decides when a trainer's failed step starts a fresh generation with nobody replaced
    (``regroup``), and puts the record back when another writer changed it (``guard``). A
    failover's generation is the coordinator's decision (``advance``, then ``publish``)."""

    def __init__(
        self,
        *,
        store: JobStore,
        members: Members,
        world_size: int,
        deadlines: Deadlines,
        moved: Callable[[str], bool],
        last_commit: Callable[[], int | None],
        failed: Callable[[], bool],
        last_beat: Callable[[Member, float], float],
        announce: Callable[[int], None],
    ):
        """``moved``: whether a plain counter of the store moved since the last look;
        ``last_commit``: the job's last global commit; ``failed``: whether the job failed;
        ``last_beat``: when a member's heartbeat last rose (looks now); ``announce``: tell the
        liveness endpoint a number once the store has it."""
        self._store, self._members, self._world_size, self._deadlines = store, members, world_size, deadlines
        self._moved, self._last_commit, self._failed, self._last_beat = moved, last_commit, failed, last_beat
        self._announce = announce
        self.number = 0
        self.regroups: list[dict] = []  # fresh generations after a step failed with no death
        self._checked_at = 0.0  # the whole record, checked that often
        self._regroup_asked_at: float | None = None

    def advance(self) -> int:
        """The next generation's number, now the current one (``publish`` it once its failover
        record is written)."""
        self.number += 1
        return self.number

    def restore(self) -> int:
        """A coordinator taking over: the number of the generation in the store; returns it."""
        current = self._store.get(keys.generation())
        if current is None:  # the coordinator takes over only a store that holds one
            raise JobStateError("the job store holds no (verified) generation record to take over from")
        self.number = current.number
        self._announce(self.number)
        return self.number

    def publish(self) -> None:
        """The generation and each rank's trainer in it: the epochs receivers accept."""
        # One pass over the members (a lookup per rank was O(N^2): 0.45 s of every promotion at 1,024 ranks).
        live: dict[int, int] = {}
        for m in self._members.alive(Role.TRAINER):
            live.setdefault(m.rank, m.id)
        trainers = tuple(live.get(r, -1) for r in range(self._world_size))
        publish_generation(self._store, Generation(number=self.number, trainers=trainers))
        self._announce(self.number)  # after the store: an answer never carries a number ahead of it

    def guard(self) -> None:
        """Put the generation record back if anyone overwrote or deleted it (roles keep the
        last one they verified meanwhile; newcomers need it to find their epochs). Its
        number each poll; the whole record (every rank's member) when that is off, and
        each ``BEAT_SCAN``."""
        number = self._store.get(keys.generation_number())
        if (
            number is not None
            and number.value == self.number
            and time.time() - self._checked_at < timing.BEAT_SCAN.total_seconds()
        ):
            return
        self._checked_at = time.time()
        current = self._store.get(keys.generation())
        if current is None or current.number != self.number:
            logger.warning("the generation record in the job store was overwritten or removed; publishing it again")
            self.publish()

    def regroup(self, now: float) -> None:
        """A trainer's step failed in the current generation with no death (a collective or
        rendezvous timed out on a loaded machine): once a death had its deadline to show,
        every trainer rolls back to the last commit and redoes the step in a fresh
        generation, exactly as after a failover but with nobody replaced."""
        if not self._moved(keys.regroup_count()) and self._regroup_asked_at is None:
            return  # no rank asked since the last look, and none is waiting
        requests = self._store.get_many([keys.regroup(r) for r in range(self._world_size)])
        asked = [r for r, req in enumerate(requests) if req is not None and req.generation == self.number]
        if not asked or self._failed() or self._last_commit() is None:
            self._regroup_asked_at = None
            return
        if self._regroup_asked_at is None:
            self._regroup_asked_at = now
        if now - self._regroup_asked_at < self._deadlines.trainer.total_seconds():
            return
        # A trainer silent now may be dead: its own deadline decides, and a failover regroups
        # every trainer anyway. (A coordinator that just took over starts both clocks at once,
        # the request's and the silence's: the request's first look came a poll earlier.)
        if any(
            now - self._last_beat(m, now) > timing.GONE_AFTER.total_seconds() for m in self._members.alive(Role.TRAINER)
        ):
            return
        self._regroup_asked_at = None
        commit = self._last_commit()
        assert commit is not None  # read above: the record's last commit never goes back to None
        g = self.advance()
        self._store.put(keys.failover(g), FailoverRecord(generation=g, commit=commit, rank=-1, member=-1))
        self.publish()
        self.regroups.append({"generation": g, "commit": commit, "asked_by": asked, "at": now})
        logger.warning(
            "trainers %s found generation %d failed with no death: generation %d resumes from commit %s "
            "with the same trainers",
            asked,
            g - 1,
            g,
            commit,
        )
