"""The coordinator's liveness logic, whole: when each member was last heard (the liveness
endpoint's table and the store's heartbeat keys), the silence past which it is dead (its role's
deadline, or a short one that confirms a transport report), and the judgement of a silence.

A member silent past its deadline is dead only once a second channel confirms it (``probe``:
its agent's view of the process), and never on deadlines alone when many are silent together
(a stall of the machine, not N deaths). The coordinator's own stalls do not count toward
anyone's silence (``StallLog``)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from replica.jobstore import Heartbeat, JobStore, Text, keys
from replica.roles import timing
from replica.roles.env import ROLES, Role
from replica.roles.members import Decision, Member, Members, MemberState
from replica.roles.probe import Verdict
from replica.roles.stalls import StallLog
from replica.roles.timing import Deadlines

__all__ = ["Liveness"]

logger = logging.getLogger(__name__)


class Liveness:
    """Owns the coordinator's liveness endpoint (``endpoint``, a UDP socket on ``host``; None:
    every beat is a store write), each rank's transport reports as last read, when every beat was
    last read (``beats_read_at``), the coordinator's own stalls (``stalls``), the silences held
    as suspected stalls (``suspected_stalls``) and the second look at a silent member (``probe``).
    Of each member it writes only its beat fields (``beats``, ``beat_at``, ``checked_at``,
    ``max_silence_s``, ``lost_base``).

    Decides which live members are dead (``judge``): silent past their deadline and confirmed,
    or their standby reported the connection gone and a short silence confirms it. It says so
    through ``declare_dead``; what a death leads to (a promotion, a replacement) is not its."""

    def __init__(
        self,
        *,
        store: JobStore,
        members: Members,
        deadlines: Deadlines,
        host: str,
        endpoint: bool,
        moved: Callable[[str], bool],
        lost_reports: Callable[[], dict[int, int]],
        declare_dead: Callable[[Member, str], list[Decision]],
    ):
        """``endpoint``: start the liveness endpoint on ``host`` (any free port; its address is
        published as ``keys.liveness()``). ``moved``: whether a plain counter of the store moved
        since the last look; ``lost_reports``: every rank's transport reports, read from the store."""
        self._store, self._members, self._deadlines = store, members, deadlines
        self._moved, self._read_lost, self._declare_dead = moved, lost_reports, declare_dead
        self.host = host
        #: The liveness endpoint (None: beats in the store only).
        self.endpoint = store.liveness_server(host) if endpoint else None
        #: When every beat was last read (``read``: each ``BEAT_SCAN``).
        self.beats_read_at = 0.0
        self._lost: dict[int, int] = {}  # each rank's transport reports, as last read
        #: The coordinator's own stalls (gaps between its polls): silence in them is not counted.
        self.stalls = StallLog(after=timing.COORDINATOR_STALL, keep=timing.STALL_MEMORY)
        #: A second look at a member silent past its deadline (its agent's view of the process);
        #: None: the deadline alone decides (no agent sees the roles' processes).
        self.probe: Callable[[Member], tuple[Verdict, str]] | None = None
        self.suspected_stalls: list[dict] = []  # silences judged stalls, not deaths (for the report)
        self._held: dict[int, dict] = {}  # member id -> its open entry of suspected_stalls

    # --- the endpoint ---

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()

    def _address(self, port: int) -> str:
        return f"{self.host}:{port}"

    def publish(self) -> None:
        """Publish the endpoint's address, where the roles' beats go."""
        if self.endpoint is not None:
            self._store.put(keys.liveness(), Text(value=self._address(self.endpoint.port)))

    def set_generation(self, number: int) -> None:
        """The generation the endpoint's answers carry (after the store has it)."""
        if self.endpoint is not None:
            self.endpoint.set_generation(number)

    def report(self) -> dict | None:
        """What the liveness endpoint heard (None: the beats went to the store only)."""
        if self.endpoint is None:
            return None
        survivors = [m.id for m in self._members.rows if m.state != MemberState.DEAD]  # alive, or done at the end
        return {
            "endpoint": self._address(self.endpoint.port),
            "datagrams": self.endpoint.received,
            "rejected": self.endpoint.rejected,
            "members": len(survivors),
            "members_heard": sum(1 for age in self.endpoint.ages(survivors) if age >= 0),
        }

    # --- the beats ---

    def restore(self, members: list[Member]) -> None:
        """A coordinator taking over: each of ``members``' beat counter as the store holds it, in one
        request (the silence is timed from the takeover)."""
        beats = self._store.get_many([keys.heartbeat(m.id) for m in members])
        for member, beat in zip(members, beats, strict=False):
            member.beats = beat.beat if beat is not None and beat.member == member.id else 0

    def lost_reports(self) -> dict[int, int]:
        """Each rank's transport reports (its standby saw its trainer's connection vanish), read
        again when their counter moved."""
        if self._moved(keys.lost_count()):
            self._lost = self._read_lost()
        return self._lost

    def last_beat(self, member: Member, now: float) -> float:
        """When (on this clock) the member's signed heartbeat counter last rose
        (a forged or replayed beat moves nothing); looks now."""
        if self._heard([member], now):
            self._beat_read(member, self._store.get(keys.heartbeat(member.id)), now)
        return member.beat_at

    @staticmethod
    def _beat_read(member: Member, beat: Heartbeat | None, now: float) -> None:
        if beat is not None and beat.member == member.id:
            Liveness._beat_rose(member, beat.beat, now)

    @staticmethod
    def _beat_rose(member: Member, number: int, at: float) -> None:
        if number > member.beats and at >= member.beat_at:
            member.max_silence_s = max(member.max_silence_s, at - member.beat_at)
            member.beats, member.beat_at = number, at

    def _heard(self, members: list[Member], now: float) -> list[Member]:
        """Take each member's newest beat heard by the liveness endpoint (in memory, verified
        there); returns the members it has not heard for LIVENESS_STORE_AFTER (or never),
        whose beats go to the store meanwhile."""
        if self.endpoint is None:
            return members
        ids = [m.id for m in members]
        unheard = []
        for member, age, number in zip(members, self.endpoint.ages(ids), self.endpoint.beats(ids), strict=False):
            if age >= 0:
                self._beat_rose(member, number, now - age)
            if age < 0 or age > timing.LIVENESS_STORE_AFTER.total_seconds():
                unheard.append(member)
        return unheard

    def _limit(self, member: Member, now: float) -> tuple[float, bool]:
        """The silence (s) past which ``member`` is dead, and whether its standby reported its
        connection gone (then a short silence confirms it)."""
        deadline = self._deadlines.of(member.role).total_seconds()
        if member.role != Role.TRAINER:
            return deadline, False
        reports = self._lost.get(member.rank, 0)
        # A report this soon after the promotion may still be about its predecessor.
        if now - member.since < timing.LATE_REPORT.total_seconds():
            member.lost_base = reports
        if reports > member.lost_base:
            return min(deadline, self._deadlines.confirm.total_seconds()), True
        return deadline, False

    def read(self, now: float) -> None:
        """A poll's reads: the transport reports when their counter moved; every live member's
        beat each ``BEAT_SCAN``, and between those the beats of the members overdue."""
        self.lost_reports()
        if now - self.beats_read_at >= timing.BEAT_SCAN.total_seconds():
            self._read_beats(now)
        else:
            self._recheck_overdue(now)

    def _recheck_overdue(self, now: float) -> None:
        """Between reads of every beat, each poll: the members the liveness endpoint's table
        (in memory) shows silent past their ``_limit`` have their beats read now, the
        store's too where they beat there, and their silence is measured as of now. A deadline
        is met within a poll, not up to a ``BEAT_SCAN`` late (a freeze was found 2.7-2.9 s after
        a 2.5 s deadline at 1,024 ranks, bench-scale)."""
        if self.endpoint is None:
            return
        members = self._members.alive()
        floor = min(self._deadlines.confirm, *(self._deadlines.of(role) for role in ROLES)).total_seconds()
        ages = self.endpoint.ages([m.id for m in members])
        # The endpoint's age is a lower bound of the silence (a store beat can only be newer than
        # the datagram's), so members it heard lately are not overdue.
        candidates = [m for m, age in zip(members, ages, strict=False) if age < 0 or age > floor]
        if not candidates:
            return
        unheard = {m.id for m in self._heard(candidates, now)}
        overdue = [m for m in candidates if now - m.beat_at > self._limit(m, now)[0]]
        stale = [m for m in overdue if m.id in unheard]
        if stale:
            for member, beat in zip(stale, self._store.get_many([keys.heartbeat(m.id) for m in stale]), strict=False):
                self._beat_read(member, beat, now)
        for member in overdue:
            member.checked_at = now

    def _read_beats(self, now: float) -> None:
        """Every live member's heartbeat: from the liveness endpoint's table, and for the
        members it has not heard lately from the store, in one request (each member's key is
        written at its admission, so none is missing: a missing one would make it a request
        per key)."""
        unheard = self._heard(self._members.alive(), now)
        if unheard:
            for member, beat in zip(
                unheard, self._store.get_many([keys.heartbeat(m.id) for m in unheard]), strict=False
            ):
                self._beat_read(member, beat, now)
        self.beats_read_at = now

    # --- the judgement ---

    def note_own_stall(self, now: float) -> None:
        """The coordinator polls at ``now``: a gap since its last poll is its own stall."""
        stall = self.stalls.tick(now)
        if stall is not None and stall.seconds >= timing.STALL_LOGGED.total_seconds():
            logger.warning(
                "the coordinator did not run for %.1f s (its process stalled): silence in that span "
                "counts against no member",
                stall.seconds,
            )

    def _silence(self, member: Member) -> float:
        """How long ``member`` has been silent as of the last read of its beats (never longer
        than it was), from its last beat or from when it took its role (a promoted standby's
        deadline starts at its promotion), less the coordinator's own stalls."""
        asof = max(self.beats_read_at, member.checked_at)
        return self.stalls.silence(max(member.beat_at, member.since), asof)

    def judge(self, now: float, *, done: Callable[[Member], bool]) -> list[Decision]:
        """Judge every live member on the beats ``read`` last: one whose standby reported its
        connection gone is dead once silent for ``deadlines.confirm``; one silent past its role's
        deadline goes to ``_judge_silent``. ``done``: whether a member finished its work (then
        it is not judged); it may mark it so."""
        decisions: list[Decision] = []
        overdue: list[tuple[Member, float, float]] = []
        quiet = 0  # members silent for QUIET or longer
        for member in self._members.alive():
            if done(member):
                continue
            silent = self._silence(member)
            quiet += silent >= timing.QUIET.total_seconds()
            _, lost = self._limit(member, now)
            if lost and silent > self._deadlines.confirm.total_seconds():
                decisions += self._declare_dead(
                    member,
                    f"its standby saw the connection vanish and it has sent no heartbeat for {silent * 1e3:.0f} ms",
                )
            elif silent > (deadline := self._deadlines.of(member.role).total_seconds()):
                overdue.append((member, silent, deadline))
        return decisions + self._judge_silent(overdue, quiet, now)

    def _host_worth(self) -> int:
        """The most live members on one host."""
        return max(collections.Counter(m.host for m in self._members.alive()).values(), default=0)

    def _judge_silent(self, overdue: list[tuple[Member, float, float]], quiet: int, now: float) -> list[Decision]:
        """``overdue``: (member, silence, deadline) of the members silent past their deadline
        in this poll; ``quiet``: how many live members have been silent for ``QUIET`` or longer.
        Each overdue one is dead once confirmed (``probe``); a stalled one is held until
        ``STALL_HOLD``. More than one host's worth quiet at once (or every member, two or more)
        is a suspected stall of the machine: held, unless the process or its host is gone."""
        late = {m.id for m, _, _ in overdue}
        alive = {m.id for m in self._members.alive()}
        for member_id in [i for i in self._held if i not in late]:
            entry = self._held.pop(member_id)
            if member_id not in alive:  # its exit came, or its work ended, while it was held
                entry.update(outcome="left", until=now)
                continue
            entry.update(outcome="recovered", until=now)  # heard again: it was a stall
            logger.warning(
                "%s is heard again after %.1f s of silence: it was a stall, not a death",
                entry["member"],
                now - entry["at"] + entry["silent_s"],
            )
        if not overdue:
            return []
        looks = {}
        for member, silent, _ in overdue:
            held = self._held.get(member.id)
            if (
                held is not None
                and now - held["looked"] < timing.PROBE_EVERY.total_seconds()
                and (silent <= timing.STALL_HOLD.total_seconds())
            ):
                continue  # looked at lately: still held
            looks[member.id] = (Verdict.UNKNOWN, "") if self.probe is None else self.probe(member)
            if held is not None:
                held["looked"] = now
        # A process or host that is gone explains its silence; the others silent together are a suspected stall.
        gone = sum(1 for verdict, _ in looks.values() if verdict == Verdict.GONE)
        quiet, alive = quiet - gone, len(self._members.alive()) - gone
        together = quiet >= 2 and (quiet == alive or quiet > self._host_worth())
        if together and not any(self._held.get(m.id, {}).get("together") for m, _, _ in overdue):
            logger.warning(
                "suspected stall: %d of %d members silent together: none is declared dead on its deadline alone",
                quiet,
                alive,
            )
        decisions = []
        for member, silent, deadline in overdue:
            if member.id not in looks:
                continue
            verdict, why = looks[member.id]
            said = f"no heartbeat for {silent:.1f} s (the {member.role} deadline is {deadline:g} s)"
            dead = verdict == Verdict.GONE or (not together and verdict in (Verdict.DEAD, Verdict.UNKNOWN))
            if dead or silent > timing.STALL_HOLD.total_seconds():
                entry = self._held.pop(member.id, None)
                if entry is not None:
                    entry.update(outcome="dead", until=now)
                if not dead:
                    said += f", longer than a stall may last ({timing.STALL_HOLD.total_seconds():g} s)"
                decisions += self._declare_dead(member, f"{said}; {why}" if why else said)
            elif member.id not in self._held:
                why = why or "nothing else sees its process"
                entry = {
                    "member": str(member),
                    "role": member.role,
                    "rank": member.rank,
                    "at": now,
                    "silent_s": round(silent, 3),
                    "why": why,
                    "together": together,
                    "outcome": None,
                    "until": None,
                    "looked": now,
                }
                self._held[member.id] = entry
                self.suspected_stalls.append(entry)
                logger.warning(
                    "%s has been silent for %.1f s but %s: a stall, not a death (held up to %g s)",
                    member,
                    silent,
                    why if not together else f"{quiet} members are silent together",
                    timing.STALL_HOLD.total_seconds(),
                )
        return decisions
