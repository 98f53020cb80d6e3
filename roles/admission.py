"""The coordinator's admission of joining roles: each signed join request answered
once (a member number and the generation), or refused with the reason."""

from __future__ import annotations

import logging
import time


from replica.errors import JoinRefusedError
from replica.jobstore import Heartbeat, keys
from replica.roles import timing
from replica.roles.env import ROLES, Role
from replica.roles.join import JoinRequest, answer, pending_requests, refuse_unsigned
from replica.roles.members import Member


__all__ = ["Admission"]

logger = logging.getLogger(__name__)


class Admission:
    """``Coordinator``'s part: The join requests: ``Coordinator._admit`` each poll. Mixed into ``Coordinator``, whose
    state it uses."""

    def _admit(self) -> None:
        """Answer the pending joins. Per join a few requests; per batch (a poll's), the
        generation and the membership table written once, then the answers: a job of
        thousands of members joins in one batch or a few (written per join, the table made
        its joins O(N^2): 9 s for 512 members, bench-scale)."""
        admitted: list[tuple[int, JoinRequest, Member]] = []
        live = {(m.role, m.rank) for m in self.alive()}
        finished = self.finished()
        if self._moved(keys.lost_count()):
            self._lost = self.record.all_lost_reports()
        for seq, raw in pending_requests(self.store, self._seen):
            if raw is None:  # numbered, not yet written
                first = self._numbered_at.setdefault(seq, time.monotonic())
                if time.monotonic() - first < timing.JOIN_STRAGGLE.total_seconds():
                    break
                self._seen = seq
                continue
            self._seen = seq
            try:
                request = JoinRequest.decode(raw, self._token)
            except JoinRefusedError as exc:  # its writer cannot verify a signed answer: say why, unsigned
                logger.warning("refused a join: %s", exc)
                self.refused.append({"reason": str(exc), "at": time.time()})
                refuse_unsigned(self.store, seq, str(exc))
                continue
            refused = self._refusal(request, live=live, finished=finished)
            if refused is not None:
                # The reason names who asked, never the token presented.
                logger.warning("refused a join: %s", refused)
                self.refused.append({"reason": refused, "at": time.time()})
                answer(self.store, seq, request, generation=self.generation, refused=refused)
                continue
            self._nonces.add(request.nonce)
            now = time.time()
            member = Member(id=seq, role=Role(request.role), rank=request.rank, host=request.host, pid=request.pid,
                            domain=request.domain,
                            generation=self.generation, joined_at=now, since=now, beat_at=now,
                            lost_base=self._lost.get(request.rank, 0))
            # Its heartbeat key exists from now on (unless it beat already): the read of every
            # beat in one request finds them all.
            self.store.compare_set(keys.heartbeat(member.id), None, Heartbeat(member=member.id, beat=0))
            self.members.append(member)
            live.add((member.role, member.rank))
            if not self.started and all((Role.TRAINER, r) in live for r in range(self.world_size)):
                self.started = True
            admitted.append((seq, request, member))
        if not admitted:
            return
        if any(m.role == Role.TRAINER for _, _, m in admitted):
            self._publish_generation()  # their epochs exist before they can stream
        self._publish_members()
        for seq, request, member in admitted:
            answer(self.store, seq, request, generation=self.generation)
            logger.info("admitted %s", member)

    def _refusal(self, request: JoinRequest, *, live: set[tuple[str, int]], finished: bool) -> str | None:
        """Why ``request`` is refused (None: it is not). ``live``: the (role, rank) of every
        live member, those admitted before it in this batch included."""
        who = f"{request.role} {request.rank} (pid {request.pid} on {request.host})"
        if request.nonce in self._nonces:
            return f"replayed join request of {who}"
        if request.role not in ROLES:
            return f"{who}: unknown role {request.role!r} (expected one of {ROLES})"
        ranks = self.rollouts if request.role == Role.ROLLOUT else self.world_size
        if not 0 <= request.rank < ranks:
            return f"{who}: rank {request.rank} is not in [0, {ranks})"
        if finished:
            return f"{who}: the job is over"
        if request.role == Role.TRAINER and self.started:
            return (f"{who}: the job is running (generation {self.generation}); a trainer cannot join late, "
                    f"start a standby for its rank instead")
        if (request.role, request.rank) in live:
            holder = self._live(request.role, request.rank)
            return f"{who}: rank {request.rank} already has a live {request.role}, {holder}"
        return self._misplacement(request, who)

    def _misplacement(self, request: JoinRequest, who: str) -> str | None:
        """Why ``request`` breaks the domain rule (a standby never in its trainer's failure
        domain), unless the job allows it; before the first commit the job fails on it."""
        if self.shared_domains or request.role not in (Role.TRAINER, Role.STANDBY):
            return None
        other = self._live(Role.STANDBY if request.role == Role.TRAINER else Role.TRAINER, request.rank)
        if other is None or other.domain != request.domain:
            return None
        reason = (f"{who} is in failure domain {request.domain!r}, as {other} is: losing it would lose both copies of "
                  f"rank {request.rank}; place standbys on other hosts (or set REPLICA_DOMAIN), or pass "
                  "--allow-shared-domain")
        if self.record.last() is None and self._misplaced is None:
            self._misplaced = (request.rank, reason)
        return reason
