"""The coordinator's judgement of a silence: a member silent past its deadline is dead only
once a second channel confirms it (``probe``: its agent's view of the process), and never on
deadlines alone when many are silent together (a stall of the machine, not N deaths). The
coordinator's own stalls do not count toward anyone's silence (``StallLog``)."""

from __future__ import annotations

import collections
import logging

from replica.roles import timing
from replica.roles.members import Decision, Member
from replica.roles.probe import Verdict

__all__ = ["Judgement"]

logger = logging.getLogger(__name__)


class Judgement:
    """``Coordinator``'s part: deadlines, confirmed. Mixed into ``Coordinator``, whose state it uses."""

    def _note_own_stall(self, now: float) -> None:
        stall = self.stalls.tick(now)
        if stall is not None and stall.seconds >= timing.STALL_LOGGED.total_seconds():
            logger.warning("the coordinator did not run for %.1f s (its process stalled): silence in that span "
                           "counts against no member", stall.seconds)

    def _silence(self, member: Member) -> float:
        """How long ``member`` has been silent as of the last read of its beats (never longer
        than it was), from its last beat or from when it took its role (a promoted standby's
        deadline starts at its promotion), less the coordinator's own stalls."""
        asof = max(self._beats_read_at, member.checked_at)
        return self.stalls.silence(max(member.beat_at, member.since), asof)

    def _host_worth(self) -> int:
        """The most live members on one host."""
        return max(collections.Counter(m.host for m in self.alive()).values(), default=0)

    def _judge_silent(self, overdue: list[tuple[Member, float, float]], quiet: int, now: float) -> list[Decision]:
        """``overdue``: (member, silence, deadline) of the members silent past their deadline
        in this poll; ``quiet``: how many live members have been silent for ``QUIET`` or longer.
        Each overdue one is dead once confirmed (``probe``); a stalled one is held until
        ``STALL_HOLD``. More than one host's worth quiet at once (or every member, two or more)
        is a suspected stall of the machine: held, unless the process or its host is gone."""
        late = {m.id for m, _, _ in overdue}
        alive = {m.id for m in self.alive()}
        for member_id in [i for i in self._held if i not in late]:
            entry = self._held.pop(member_id)
            if member_id not in alive:  # its exit came, or its work ended, while it was held
                entry.update(outcome="left", until=now)
                continue
            entry.update(outcome="recovered", until=now)  # heard again: it was a stall
            logger.warning("%s is heard again after %.1f s of silence: it was a stall, not a death",
                           entry["member"], now - entry["at"] + entry["silent_s"])
        if not overdue:
            return []
        looks = {}
        for member, silent, _ in overdue:
            held = self._held.get(member.id)
            if held is not None and now - held["looked"] < timing.PROBE_EVERY.total_seconds() and (
                    silent <= timing.STALL_HOLD.total_seconds()):
                continue  # looked at lately: still held
            looks[member.id] = (Verdict.UNKNOWN, "") if self.probe is None else self.probe(member)
            if held is not None:
                held["looked"] = now
        # A process or host that is gone explains its silence; the others silent together are a suspected stall.
        gone = sum(1 for verdict, _ in looks.values() if verdict == Verdict.GONE)
        quiet, alive = quiet - gone, len(self.alive()) - gone
        together = quiet >= 2 and (quiet == alive or quiet > self._host_worth())
        if together and not any(self._held.get(m.id, {}).get("together") for m, _, _ in overdue):
            logger.warning("suspected stall: %d of %d members silent together: none is declared dead on its "
                           "deadline alone", quiet, alive)
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
                decisions += self.declare_dead(member, f"{said}; {why}" if why else said)
            elif member.id not in self._held:
                why = why or "nothing else sees its process"
                entry = {"member": str(member), "role": member.role, "rank": member.rank, "at": now,
                         "silent_s": round(silent, 3), "why": why, "together": together, "outcome": None,
                         "until": None, "looked": now}
                self._held[member.id] = entry
                self.suspected_stalls.append(entry)
                logger.warning("%s has been silent for %.1f s but %s: a stall, not a death (held up to %g s)", member,
                               silent, why if not together else f"{quiet} members are silent together",
                               timing.STALL_HOLD.total_seconds())
        return decisions
