"""The coordinator's view of its members' heartbeats: the liveness endpoint's table and
the store's heartbeat keys, read into each member's last beat."""

from __future__ import annotations

import logging


from replica.jobstore import Heartbeat, Text, keys
from replica.roles import timing
from replica.roles.env import ROLES, Role
from replica.roles.members import Member, MemberState


__all__ = ["Beats"]

logger = logging.getLogger(__name__)


class Beats:
    """``Coordinator``'s part: Heartbeats: when each member was last heard. Mixed into ``Coordinator``, whose
    state it uses."""

    def _liveness_address(self) -> str:
        return f"{self._liveness_host}:{self.liveness.port}"

    def _publish_liveness(self) -> None:
        if self.liveness is not None:
            self.store.put(keys.liveness(), Text(value=self._liveness_address()))

    def liveness_report(self) -> dict | None:
        """What the liveness endpoint heard (None: the beats went to the store only)."""
        if self.liveness is None:
            return None
        survivors = [m.id for m in self.members if m.state != MemberState.DEAD]  # alive, or done at the end
        return {"endpoint": self._liveness_address(), "datagrams": self.liveness.received,
                "rejected": self.liveness.rejected, "members": len(survivors),
                "members_heard": sum(1 for age in self.liveness.ages(survivors) if age >= 0)}

    def _live(self, role: str, rank: int) -> Member | None:
        return next((m for m in self.alive(role) if m.rank == rank), None)

    def _last_beat(self, member: Member, now: float) -> float:
        """When (on this clock) the member's signed heartbeat counter last rose
        (a forged or replayed beat moves nothing); looks now."""
        if self._heard([member], now):
            self._beat_read(member, self.store.get(keys.heartbeat(member.id)), now)
        return member.beat_at

    @staticmethod
    def _beat_read(member: Member, beat: Heartbeat | None, now: float) -> None:
        if beat is not None and beat.member == member.id:
            Beats._beat_rose(member, beat.beat, now)

    @staticmethod
    def _beat_rose(member: Member, number: int, at: float) -> None:
        if number > member.beats and at >= member.beat_at:
            member.max_silence_s = max(member.max_silence_s, at - member.beat_at)
            member.beats, member.beat_at = number, at

    def _heard(self, members: list[Member], now: float) -> list[Member]:
        """Take each member's newest beat heard by the liveness endpoint (in memory, verified
        there); returns the members it has not heard for LIVENESS_STORE_AFTER (or never),
        whose beats go to the store meanwhile."""
        if self.liveness is None:
            return members
        ids = [m.id for m in members]
        unheard = []
        for member, age, number in zip(members, self.liveness.ages(ids), self.liveness.beats(ids)):
            if age >= 0:
                self._beat_rose(member, number, now - age)
            if age < 0 or age > timing.LIVENESS_STORE_AFTER.total_seconds():
                unheard.append(member)
        return unheard

    def _limit(self, member: Member, now: float) -> tuple[float, bool]:
        """The silence (s) past which ``member`` is dead, and whether its standby reported its
        connection gone (then a short silence confirms it)."""
        deadline = self.deadlines.of(member.role).total_seconds()
        if member.role != Role.TRAINER:
            return deadline, False
        reports = self._lost.get(member.rank, 0)
        # A report this soon after the promotion may still be about its predecessor.
        if now - member.since < timing.LATE_REPORT.total_seconds():
            member.lost_base = reports
        if reports > member.lost_base:
            return min(deadline, self.deadlines.confirm.total_seconds()), True
        return deadline, False

    def _recheck_overdue(self, now: float) -> None:
        """Between reads of every beat, each poll: the members the liveness endpoint's table
        (in memory) shows silent past their ``_limit`` have their beats read now, the
        store's too where they beat there, and their silence is measured as of now. A deadline
        is met within a poll, not up to a ``BEAT_SCAN`` late (a freeze was found 2.7-2.9 s after
        a 2.5 s deadline at 1,024 ranks, bench-scale)."""
        if self.liveness is None:
            return
        members = self.alive()
        floor = min(self.deadlines.confirm, *(self.deadlines.of(role) for role in ROLES)).total_seconds()
        ages = self.liveness.ages([m.id for m in members])
        # The endpoint's age is a lower bound of the silence (a store beat can only be newer than
        # the datagram's), so members it heard lately are not overdue.
        candidates = [m for m, age in zip(members, ages) if age < 0 or age > floor]
        if not candidates:
            return
        unheard = {m.id for m in self._heard(candidates, now)}
        overdue = [m for m in candidates if now - m.beat_at > self._limit(m, now)[0]]
        stale = [m for m in overdue if m.id in unheard]
        if stale:
            for member, beat in zip(stale, self.store.get_many([keys.heartbeat(m.id) for m in stale])):
                self._beat_read(member, beat, now)
        for member in overdue:
            member.checked_at = now

    def _read_beats(self, now: float) -> None:
        """Every live member's heartbeat: from the liveness endpoint's table, and for the
        members it has not heard lately from the store, in one request (each member's key is
        written at its admission, so none is missing: a missing one would make it a request
        per key)."""
        unheard = self._heard(self.alive(), now)
        if unheard:
            for member, beat in zip(unheard, self.store.get_many([keys.heartbeat(m.id) for m in unheard])):
                self._beat_read(member, beat, now)
        self._beats_read_at = now
