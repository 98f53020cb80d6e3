"""The coordinator's generation record: published whole (every rank's member) with its
number after it, guarded against a writer that is not this coordinator, taken over
from the store by a coordinator elected after another died, and renewed after a
step failed with no death (a regroup)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict


from replica.jobstore.commit import publish_generation
from replica.errors import JoinRefusedError
from replica.jobstore import Failover as FailoverRecord
from replica.jobstore import Generation, Text, keys
from replica.roles import timing
from replica.roles.env import Role
from replica.roles.join import JoinRequest, answer
from replica.roles.members import Member, MemberState


__all__ = ["Generations"]

logger = logging.getLogger(__name__)


class Generations:
    """``Coordinator``'s part: The generation record and the membership table. Mixed into ``Coordinator``, whose
    state it uses."""

    def _take_over(self) -> None:
        """Rebuild the coordinator's view from the store: the generation, the membership
        table (every live member's deadline runs from now), the join requests answered
        (one its predecessor admitted but did not answer is answered now), the ranks
        without protection. The failover history before this point stays in the
        predecessor's report."""
        now = time.time()
        generation = self.store.get(keys.generation())
        self.generation = generation.number
        if self.liveness is not None:
            self.liveness.set_generation(self.generation)
        self.takeover = {"at": now, "attempt": self.attempt, "generation": self.generation,
                         "commit": self.record.last()}
        # Every member's keys in a few requests, not a few each (a takeover at 1,024 ranks read
        # ~12,000 keys one by one on etcd).
        table = self.store.get(keys.members())
        rows = json.loads(table.value) if table is not None else []
        lost = self.record.all_lost_reports()
        beats = self.store.get_many([keys.heartbeat(int(row["id"])) for row in rows])
        for row, beat in zip(rows, beats):
            member = Member(id=int(row["id"]), role=Role(row["role"]), rank=int(row["rank"]), host=str(row["host"]),
                            domain=str(row.get("domain") or row["host"]), pid=int(row["pid"]),
                            generation=int(row["generation"]), joined_at=now, since=now,
                            state=MemberState(row["state"]), beat_at=now, lost_base=lost.get(int(row["rank"]), 0),
                            max_silence_s=float(row.get("max_silence_s", 0.0)))
            member.beats = beat.beat if beat is not None and beat.member == member.id else 0
            self.members.append(member)
        self.started = self.record.last() is not None or {
            m.rank for m in self.members if m.role == Role.TRAINER} >= set(range(self.world_size))
        requests = self.store.read_raw_many([self.store.full(keys.join_request(m.id)) for m in self.members])
        replies = self.store.get_many([keys.join_reply(m.id) for m in self.members])
        for member, request, reply in zip(self.members, requests, replies):
            self._seen = max(self._seen, member.id)
            if request is None:
                continue
            try:
                joined = JoinRequest.decode(request, self._token)
            except JoinRefusedError as exc:  # overwritten since: it admits nobody
                logger.warning("join request %d no longer verifies: %s", member.id, exc)
                continue
            self._nonces.add(joined.nonce)  # a replay of an admitted request stays refused
            if reply is None:  # admitted by the predecessor, which died first
                answer(self.store, member.id, joined, generation=self.generation)
        flags = self.store.get_many([keys.unprotected(r) for r in range(self.world_size)])
        for rank, flag in enumerate(flags):
            if flag is not None:
                self.unprotected.add(rank)
                self._unprotected_reg[rank] = self.record.registration(rank)
        logger.warning("took over the job at generation %d, commit %s, with %d members (%d alive)", self.generation,
                       self.record.last(), len(self.members), len(self.alive()))

    def _regroup(self, now: float) -> None:
        """A trainer's step failed in the current generation with no death (a collective or
        rendezvous timed out on a loaded machine): once a death had its deadline to show,
        every trainer rolls back to the last commit and redoes the step in a fresh
        generation, exactly as after a failover but with nobody replaced."""
        if not self._moved(keys.regroup_count()) and self._regroup_asked_at is None:
            return  # no rank asked since the last look, and none is waiting
        requests = self.store.get_many([keys.regroup(r) for r in range(self.world_size)])
        asked = [r for r, req in enumerate(requests) if req is not None and req.generation == self.generation]
        if not asked or self._failed is not None or self.record.last() is None:
            self._regroup_asked_at = None
            return
        if self._regroup_asked_at is None:
            self._regroup_asked_at = now
        if now - self._regroup_asked_at < self.deadlines.trainer.total_seconds():
            return
        # A trainer silent now may be dead: its own deadline decides, and a failover regroups
        # every trainer anyway. (A coordinator that just took over starts both clocks at once,
        # the request's and the silence's: the request's first look came a poll earlier.)
        if any(now - self._last_beat(m, now) > timing.GONE_AFTER.total_seconds() for m in self.alive(Role.TRAINER)):
            return
        self._regroup_asked_at = None
        commit = self.record.last()
        self.generation += 1
        g = self.generation
        self.store.put(keys.failover(g), FailoverRecord(generation=g, commit=commit, rank=-1, member=-1))
        self._publish_generation()
        self.regroups.append({"generation": g, "commit": commit, "asked_by": asked, "at": now})
        logger.warning("trainers %s found generation %d failed with no death: generation %d resumes from commit %s "
                       "with the same trainers", asked, g - 1, g, commit)

    def _guard_generation(self) -> None:
        """Put the generation record back if anyone overwrote or deleted it (roles keep the
        last one they verified meanwhile; newcomers need it to find their epochs). Its
        number each poll; the whole record (every rank's member) when that is off, and
        each ``BEAT_SCAN``."""
        number = self.store.get(keys.generation_number())
        if (number is not None and number.value == self.generation
                and time.time() - self._generation_checked_at < timing.BEAT_SCAN.total_seconds()):
            return
        self._generation_checked_at = time.time()
        current = self.store.get(keys.generation())
        if current is None or current.number != self.generation:
            logger.warning("the generation record in the job store was overwritten or removed; publishing it again")
            self._publish_generation()

    def _publish_generation(self) -> None:
        """The generation and each rank's trainer in it: the epochs receivers accept."""
        # One pass over the members (a lookup per rank was O(N^2): 0.45 s of every promotion at 1,024 ranks).
        live: dict[int, int] = {}
        for m in self.alive(Role.TRAINER):
            live.setdefault(m.rank, m.id)
        trainers = tuple(live.get(r, -1) for r in range(self.world_size))
        publish_generation(self.store, Generation(number=self.generation, trainers=trainers))
        if self.liveness is not None:  # after the store: an answer never carries a number ahead of it
            self.liveness.set_generation(self.generation)

    def _publish_members(self) -> None:
        if self._members_deferred:  # within a poll: once, at its end
            self._members_dirty = True
            return
        self.store.put(keys.members(), Text(value=json.dumps(self.membership())))

    @contextlib.contextmanager
    def _members_batch(self):
        """Write the membership table (O(N) bytes) once, after the block, however many
        members it changed: a poll that declared 9 members dead at 1,024 ranks wrote it 9 times
        (0.8 s, and every decision of the poll that late)."""
        self._members_deferred = True
        try:
            yield
        finally:
            self._members_deferred = False
            if self._members_dirty:
                self._members_dirty = False
                self._publish_members()

    def membership(self) -> list[dict]:
        """The membership table: role, rank, host, domain, pid, generation and state of every member."""
        shown = ("id", "role", "rank", "host", "domain", "pid", "generation", "state", "max_silence_s")
        return [{k: round(v, 3) if k == "max_silence_s" else v for k, v in asdict(m).items() if k in shown}
                for m in self.members]
