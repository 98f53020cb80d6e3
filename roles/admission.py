"""The coordinator's admission of joining roles: each signed join request answered
once (a member number and the generation), or refused with the reason."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from replica.errors import JoinRefusedError
from replica.jobstore import Heartbeat, JobStore, keys
from replica.roles import timing
from replica.roles.env import ROLES, Role
from replica.roles.generations import Generations
from replica.roles.join import JoinRequest, answer, pending_requests, refuse_unsigned
from replica.roles.members import Member, Members

__all__ = ["Admission"]

logger = logging.getLogger(__name__)


class Admission:
    """Owns how far the job's join requests have been answered, the nonces of those admitted (a
    replay is refused), the refusals so far (``refused``, for the report), whether the job has
    ``started`` (every rank's trainer joined) and a placement found against the domain rule
    before the first commit (``misplaced``: the job fails on it, set up wrong).

    Decides who joins and who is refused, and why: a newcomer becomes a ``Member`` of the
    table with the current generation; a trainer joins only until the job has started."""

    def __init__(
        self,
        *,
        store: JobStore,
        token: bytes,
        members: Members,
        generations: Generations,
        world_size: int,
        rollouts: int,
        shared_domains: bool,
        lost_reports: Callable[[], dict[int, int]],
        last_commit: Callable[[], int | None],
        finished: Callable[[], bool],
    ):
        """``token``: the job's, which every request is signed under; ``generations``: the
        number a newcomer joins in, published again when trainers join; ``lost_reports``: each
        rank's transport reports (a newcomer's count from there); ``last_commit``: the job's last
        global commit; ``finished``: whether the job is over."""
        self._store, self._token, self._members, self._generations = store, token, members, generations
        self._world_size, self._rollouts, self.shared_domains = world_size, rollouts, shared_domains
        self._lost_reports, self._last_commit, self._finished = lost_reports, last_commit, finished
        self.refused: list[dict] = []
        self.started = False  # every rank's trainer has joined: no trainer may join any more
        self._seen = 0  # the join requests answered or skipped
        self._nonces: set[str] = set()
        self._numbered_at: dict[int, float] = {}
        self.misplaced: tuple[int, str] | None = None  # a rank placed against the domain rule, and why

    def admit(self) -> None:
        """Answer the pending joins. Per join a few requests; per batch (a poll's), the
        generation and the membership table written once, then the answers: a job of
        thousands of members joins in one batch or a few (written per join, the table made
        its joins O(N^2): 9 s for 512 members, bench-scale)."""
        admitted: list[tuple[int, JoinRequest, Member]] = []
        live = {(m.role, m.rank) for m in self._members.alive()}
        finished = self._finished()
        lost = self._lost_reports()
        for seq, raw in pending_requests(self._store, self._seen):
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
                refuse_unsigned(self._store, seq, str(exc))
                continue
            refused = self._refusal(request, live=live, finished=finished)
            if refused is not None:
                # The reason names who asked, never the token presented.
                logger.warning("refused a join: %s", refused)
                self.refused.append({"reason": refused, "at": time.time()})
                answer(self._store, seq, request, generation=self._generations.number, refused=refused)
                continue
            self._nonces.add(request.nonce)
            now = time.time()
            member = Member(
                id=seq,
                role=Role(request.role),
                rank=request.rank,
                host=request.host,
                pid=request.pid,
                domain=request.domain,
                generation=self._generations.number,
                joined_at=now,
                since=now,
                beat_at=now,
                lost_base=lost.get(request.rank, 0),
            )
            # Its heartbeat key exists from now on (unless it beat already): the read of every
            # beat in one request finds them all.
            self._store.compare_set(keys.heartbeat(member.id), None, Heartbeat(member=member.id, beat=0))
            self._members.rows.append(member)
            live.add((member.role, member.rank))
            if not self.started and all((Role.TRAINER, r) in live for r in range(self._world_size)):
                self.started = True
            admitted.append((seq, request, member))
        if not admitted:
            return
        if any(m.role == Role.TRAINER for _, _, m in admitted):
            self._generations.publish()  # their epochs exist before they can stream
        self._members.publish()
        for seq, request, member in admitted:
            answer(self._store, seq, request, generation=self._generations.number)
            logger.info("admitted %s", member)

    def restore(self, members: list[Member]) -> None:
        """A coordinator taking over: the join requests of ``members`` (the table its predecessor
        published) are answered; one its predecessor admitted but did not answer is answered now,
        and a replay of any stays refused. The job has started if it committed or every rank's
        trainer is among them."""
        self.started = self._last_commit() is not None or {m.rank for m in members if m.role == Role.TRAINER} >= set(
            range(self._world_size)
        )
        requests = self._store.read_raw_many([self._store.full(keys.join_request(m.id)) for m in members])
        replies = self._store.get_many([keys.join_reply(m.id) for m in members])
        for member, request, reply in zip(members, requests, replies, strict=False):
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
                answer(self._store, member.id, joined, generation=self._generations.number)

    def _refusal(self, request: JoinRequest, *, live: set[tuple[Role, int]], finished: bool) -> str | None:
        """Why ``request`` is refused (None: it is not). ``live``: the (role, rank) of every
        live member, those admitted before it in this batch included."""
        who = f"{request.role} {request.rank} (pid {request.pid} on {request.host})"
        if request.nonce in self._nonces:
            return f"replayed join request of {who}"
        if request.role not in ROLES:
            return f"{who}: unknown role {request.role!r} (expected one of {ROLES})"
        ranks = self._rollouts if request.role == Role.ROLLOUT else self._world_size
        if not 0 <= request.rank < ranks:
            return f"{who}: rank {request.rank} is not in [0, {ranks})"
        if finished:
            return f"{who}: the job is over"
        if request.role == Role.TRAINER and self.started:
            return (
                f"{who}: the job is running (generation {self._generations.number}); a trainer cannot join late, "
                f"start a standby for its rank instead"
            )
        if (request.role, request.rank) in live:
            holder = self._members.live(request.role, request.rank)
            return f"{who}: rank {request.rank} already has a live {request.role}, {holder}"
        return self._misplacement(request, who)

    def _misplacement(self, request: JoinRequest, who: str) -> str | None:
        """Why ``request`` breaks the domain rule (a standby never in its trainer's failure
        domain), unless the job allows it; before the first commit the job fails on it."""
        if self.shared_domains or request.role not in (Role.TRAINER, Role.STANDBY):
            return None
        other = self._members.live(Role.STANDBY if request.role == Role.TRAINER else Role.TRAINER, request.rank)
        if other is None or other.domain != request.domain:
            return None
        reason = (
            f"{who} is in failure domain {request.domain!r}, as {other} is: losing it would lose both copies of "
            f"rank {request.rank}; place standbys on other hosts (or set REPLICA_DOMAIN), or pass "
            "--allow-shared-domain"
        )
        if self._last_commit() is None and self.misplaced is None:
            self.misplaced = (request.rank, reason)
        return reason
