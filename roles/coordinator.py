"""The coordinator: hosts the job's store (commit record, membership table,
heartbeats), admits joining roles that present the job token, declares roles
dead and decides failovers.

It runs inside ``replica launch`` (whose loop is also the local agent that sees
its children exit) or alone as ``replica coordinator`` for a multi-node job,
where roles on other machines join it. A role is declared dead on (a) process
exit reported by a local agent, (b) a transport-level report — its standby saw
its connection vanish without a goodbye — confirmed by a short heartbeat
silence, or (c) a missed heartbeat deadline, set per role.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from operator import attrgetter
from typing import cast

# TCPStore is torch.distributed's documented API, but torch/distributed/__init__.py imports it from the
# private torch._C._distributed_c10d without re-exporting it: pyright calls it private.
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

from replica.errors import JobStoreAddressError, JobStoreInUseError
from replica.jobstore import ExportOutcome, ExportRequest, Flag, JobStore, Promotion, Registration, Stamp, keys
from replica.jobstore import Failover as FailoverRecord
from replica.jobstore.commit import CommitRecord
from replica.jobstore.etcd import EtcdStore
from replica.jobstore.stores import StoreAddress, StoreKind
from replica.roles.admission import Admission
from replica.roles.env import Role, host_name
from replica.roles.generations import Generations
from replica.roles.liveness import Liveness
from replica.roles.members import Decision, DecisionKind, FailoverTimeline, Mark, Member, Members, MemberState
from replica.roles.probe import Verdict
from replica.roles.timing import Deadlines

__all__ = ["Coordinator", "Deadlines", "Decision", "DecisionKind", "FailoverTimeline", "Member", "MemberState"]

logger = logging.getLogger(__name__)
# The done keys are read again this often even when their counter did not move.
_DONE_RECHECK = timedelta(seconds=2)
_DONE_SWEEP = 32  # done keys read per poll


class Coordinator:
    """Owns the job's store and commit record, the failovers and replacements decided, the ranks
    without protection, the ranks done and the job's failure; decides what a death leads to
    (``declare_dead``: a promotion, a replacement, or the job's end). The rest it delegates to
    objects of its own, each constructed here with what it needs: the membership table
    (``Members``), who joins (``Admission``), who is dead of silence (``Liveness``, whole: beats,
    deadlines, stalls, the judgement) and the generation number and record (``Generations``)."""

    def __init__(
        self,
        *,
        world_size: int,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        deadlines: Deadlines = Deadlines(),
        rollouts: int = 0,
        resume_from: int | None = None,
        store: StoreAddress | None = None,
        fence: tuple[str, bytes] | None = None,
        liveness: bool = True,
        shared_domains: bool = True,
        attempt: int = 0,
        previous: Coordinator | None = None,
    ):
        """Host the job store on ``host:port`` (a ``TCPStore``), or, with ``store`` on etcd,
        keep the job's state there: if the store holds a running job already (its
        coordinator died), this one takes over from that state (``takeover``). ``fence``: an
        elected coordinator's claim (``Leadership.claim``), which fences all its writes.

        ``liveness``: the roles beat to this coordinator's liveness endpoint, a UDP socket
        on ``host`` (any free port; its address is published as ``keys.liveness()``), not to
        the store (``JobStore.liveness_server``); False: every beat is a store write.

        ``shared_domains`` False (the launchers' default: ``--allow-shared-domain``): a standby
        and the trainer of its rank in one failure domain are refused; before the first commit
        that fails the job as set up wrong (``Decision.usage``).

        ``attempt``: the job's attempt (its returns to the durable floor so far), whose state is
        under ``keys.attempt_prefix``; ``previous``: the coordinator of the attempt before, in this
        process, whose store this one keeps (hosted or on etcd, fenced alike)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not token:
            raise ValueError("the coordinator needs the job's token")
        if previous is not None:
            raw = previous.store.raw
            self.host, self.port, self._address = previous.host, previous.port, previous.address
        elif store is not None and store.kind == StoreKind.ETCD:
            raw = store.connect(timeout=timedelta(seconds=60))
            if fence is not None:  # (an etcd address connects an EtcdStore: StoreAddress.connect)
                raw = cast(EtcdStore, raw).fenced(*fence)
            self.host, self.port, self._address = store.host, store.port, str(store)
        else:
            raw = self._host_store(host, port)
            self._address = f"{self.host}:{self.port}"
        #: The job state, signed under the token (``replica.jobstore``).
        self.store = JobStore(raw, token=token).attempt(attempt)
        self.attempt = attempt
        self.world_size = world_size
        self.rollouts = rollouts
        self.record = CommitRecord(self.store, world_size=world_size)
        self.deadlines = deadlines
        self._members = Members(self.store)
        self.failovers: list[FailoverTimeline] = []
        self.standbys_replaced: list[dict] = []
        self.unprotected: set[int] = set()
        # rank, from_commit, until_commit (None: to the end), from_at, until_at (time.time())
        self.unprotected_spans: list[dict] = []
        # A rank's standby registration when it lost protection.
        self._unprotected_reg: dict[int, Registration | None] = {}
        self.rollouts_lost: list[dict] = []
        # Exits the agent reported for members already declared dead: a process killed once its
        # deadline passed, or a death the deadline found before the agent saw the exit (for the report).
        self.late_exits: list[dict] = []
        # What a poll reads only now and then (see poll): the plain counters' last values, the ranks done.
        self._counters: dict[str, int] = {}
        self._done: set[int] = set()
        self._done_read_at = 0.0
        self._done_sweep: list[int] = []  # the ranks still to be read in the current sweep of done keys
        self._exited: set[int] = set()  # the members whose process exit an agent reported
        self.rollouts_retired: list[int] = []  # engines stopped because their machine took a trainer's place
        self._token = token
        self._failed: str | None = None
        #: When (``at``) and where (``attempt``, ``generation``, ``commit``) this coordinator took over a
        #: running job from the state in the store; None when it started the job.
        self.takeover: dict | None = None
        self._liveness = Liveness(
            store=self.store,
            members=self._members,
            deadlines=deadlines,
            host=host,
            endpoint=liveness,
            moved=self._moved,
            lost_reports=self.record.all_lost_reports,
            declare_dead=self.declare_dead,
        )
        self._generations = Generations(
            store=self.store,
            members=self._members,
            world_size=world_size,
            deadlines=deadlines,
            moved=self._moved,
            last_commit=self.record.last,
            failed=lambda: self._failed is not None,
            last_beat=self._liveness.last_beat,
            announce=self._liveness.set_generation,
        )
        self._admission = Admission(
            store=self.store,
            token=token,
            members=self._members,
            generations=self._generations,
            world_size=world_size,
            rollouts=rollouts,
            shared_domains=shared_domains,
            lost_reports=self._liveness.lost_reports,
            last_commit=self.record.last,
            finished=self.finished,
        )
        if self.store.get(keys.generation()) is not None and store is not None and store.kind == StoreKind.ETCD:
            if self.finished():
                raise JobStoreInUseError(
                    f"the job store {self._address} holds a job that has finished: give each "
                    "job a namespace of its own (etcd://HOSTS/NAMESPACE)"
                )
            self._take_over()
            self._liveness.publish()
            return
        if resume_from is not None:  # the trainers start from an export of that step: it is the first commit
            self.record.seed(resume_from)
        self._generations.publish()
        self._members.publish()
        self._liveness.publish()

    def close(self) -> None:
        """Stop the liveness endpoint (the hosted store goes with the process)."""
        self._liveness.close()

    def _take_over(self) -> None:
        """Rebuild the coordinator's view from the store: the generation, the membership
        table (every live member's deadline runs from now), the join requests answered
        (one its predecessor admitted but did not answer is answered now), the ranks
        without protection. The failover history before this point stays in the
        predecessor's report."""
        now = time.time()
        generation = self._generations.restore()
        self.takeover = {"at": now, "attempt": self.attempt, "generation": generation, "commit": self.record.last()}
        # Every member's keys in a few requests, not a few each (a takeover at 1,024 ranks read
        # ~12,000 keys one by one on etcd).
        self._members.restore(self.store.get(keys.members()), now=now, lost=self.record.all_lost_reports())
        self._liveness.restore(self._members.rows)
        self._admission.restore(self._members.rows)
        flags = self.store.get_many([keys.unprotected(r) for r in range(self.world_size)])
        for rank, flag in enumerate(flags):
            if flag is not None:
                self.unprotected.add(rank)
                self._unprotected_reg[rank] = self.record.registration(rank)
        logger.warning(
            "took over the job at generation %d, commit %s, with %d members (%d alive)",
            generation,
            self.record.last(),
            len(self.members),
            len(self.alive()),
        )

    def _host_store(self, host: str, port: int) -> TCPStore:
        # TCPStore binds every interface unless handed a socket: bind the configured host.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise JobStoreAddressError(
                f"cannot host the job store on {host}:{port}: {exc} (is another coordinator running there?)"
            ) from exc
        listener.listen(128)
        self.host, self.port = listener.getsockname()[:2]
        return TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            timeout=timedelta(seconds=60),
        )

    @property
    def address(self) -> str:
        return self._address

    def next_attempt(self, *, resume_from: int | None) -> Coordinator:
        """The coordinator of this job's next attempt (``roles/attempts.py``), in this process:
        the same job (world, deadlines, rollouts, domain rule, token) on this one's store, under
        the next attempt's prefix, its first step after ``resume_from`` (None: from the start)."""
        return Coordinator(
            world_size=self.world_size,
            token=self._token,
            host=self._liveness.host,
            deadlines=self.deadlines,
            rollouts=self.rollouts,
            resume_from=resume_from,
            shared_domains=self.shared_domains,
            attempt=self.attempt + 1,
            previous=self,
        )

    @property
    def token(self) -> bytes:
        """The job's token."""
        return self._token

    @property
    def failure(self) -> str | None:
        """Why the job failed (None: it did not)."""
        return self._failed

    # --- what its parts own, under the names it had (read-only) ---

    members = property(attrgetter("_members.rows"), doc="Every member that joined, in the order they joined.")
    generation = property(attrgetter("_generations.number"), doc="The current generation's number.")
    regroups = property(
        attrgetter("_generations.regroups"), doc="Fresh generations after a step failed with no death (for the report)."
    )
    refused = property(attrgetter("_admission.refused"), doc="The join requests refused, and why.")
    started = property(
        attrgetter("_admission.started"), doc="Every rank's trainer has joined: no trainer may join any more."
    )
    shared_domains = property(
        attrgetter("_admission.shared_domains"), doc="A standby may share its trainer's failure domain."
    )
    liveness = property(attrgetter("_liveness.endpoint"), doc="The liveness endpoint (None: beats in the store only).")
    stalls = property(attrgetter("_liveness.stalls"), doc="The coordinator's own stalls (``StallLog``).")
    suspected_stalls = property(
        attrgetter("_liveness.suspected_stalls"), doc="Silences judged stalls, not deaths (for the report)."
    )

    @property
    def probe(self) -> Callable[[Member], tuple[Verdict, str]] | None:
        """A second look at a member silent past its deadline (``Liveness.probe``)."""
        return self._liveness.probe

    @probe.setter
    def probe(self, probe: Callable[[Member], tuple[Verdict, str]] | None) -> None:
        self._liveness.probe = probe

    def liveness_report(self) -> dict | None:
        """What the liveness endpoint heard (None: the beats went to the store only)."""
        return self._liveness.report()

    def membership(self) -> list[dict]:
        """The membership table: role, rank, host, domain, pid, generation and state of every member."""
        return self._members.table()

    # --- the agent's calls ---

    def poll(self) -> list[Decision]:
        """Admit joins, then look for deaths; call every few tens of ms. A few requests
        a poll whatever the job's size: every member's heartbeat is read in one request
        each ``BEAT_SCAN``; done flags, transport reports and regroup requests (a key per
        rank) only when their counters moved."""
        with self._members.batch():
            return self._poll()

    def _poll(self) -> list[Decision]:
        decisions = self._check_fatal()
        self._liveness.note_own_stall(time.time())
        self._admission.admit()
        self._reprotect()
        self._generations.guard()
        now = time.time()
        self._liveness.read(now)
        self._refresh_done()
        self._generations.regroup(now)
        return decisions + self._liveness.judge(now, done=self._mark_done)

    def _reprotect(self) -> None:
        """An unprotected rank is protected again once a live standby of it has published its
        mirror (after building its model: until then the trainer would wait on it) and holds the
        rank's newest commit (its first snapshot acknowledged), not at its join: a trainer that
        dies before that takes the rank's state with it."""
        for rank in sorted(self.unprotected):
            current = self.record.registration(rank)
            if (
                current is None
                or current == self._unprotected_reg.get(rank)
                or not self._members.live(Role.STANDBY, rank)
            ):
                continue
            if not self.record.standby_holds(rank, self.record.last() or 0):
                continue
            self.unprotected.discard(rank)
            self.record.set_unprotected(rank, False)
            for span in self.unprotected_spans:
                if span["rank"] == rank and span["until_commit"] is None:
                    span["until_commit"], span["until_at"] = self.record.last(), time.time()
            logger.warning("rank %d is protected again by its new standby", rank)

    def process_exited(self, pid: int, code: int, *, host: str | None = None) -> list[Decision]:
        """A local agent saw process ``pid`` exit with ``code``."""
        decisions = self._check_fatal()
        self._admission.admit()
        host = host or host_name()
        # A live member first: pids are reused (pid_max may be 32768), and a dead member may hold this one.
        member = next((m for m in self.alive() if m.pid == pid and m.host == host), None) or next(
            (m for m in self.members if m.pid == pid and m.host == host), None
        )
        if member is None:
            if not self.finished():
                decisions.append(self._fail(-1, f"process {pid} exited with code {code} before it joined the job"))
            return decisions
        self._exited.add(member.id)
        if member.state == MemberState.DEAD:
            self._late_exit(member, code)
        if member.state != MemberState.ALIVE:
            return decisions
        if self._mark_done(member, fresh=True):  # its done key may be newer than the last poll
            return decisions
        if (member.role == Role.STANDBY and self.finished()) or (
            member.role == Role.ROLLOUT and (code == 0 or self.finished())
        ):
            member.state = MemberState.DONE  # a rollout exits 0 when told to stop (finished, or retired)
            return decisions
        return decisions + self.declare_dead(member, f"exit code {code}")

    def exited_after_end(self, pid: int, code: int, *, host: str | None = None) -> None:
        """An exit reported after the job's end: a dead member's (a zombie killed once its host
        was back) is recorded in ``late_exits``; nothing is decided any more. A live member's
        is its leaving (``still_here`` no longer counts it)."""
        host = host or host_name()
        ours = [m for m in self.members if m.pid == pid and m.host == host]
        member = next((m for m in ours if m.state != MemberState.DEAD), None)
        if member is not None:  # a role that saw the end and left
            self._exited.add(member.id)
        elif (member := next(iter(ours), None)) is not None:
            self._late_exit(member, code)

    def _late_exit(self, member: Member, code: int) -> None:
        self.late_exits.append(
            {"member": member.id, "role": member.role, "rank": member.rank, "code": code, "at": time.time()}
        )

    def hosts_silent(self, hosts: set[str]) -> list[Decision]:
        """The agents of ``hosts`` have been silent past the trainer deadline (the host is
        lost or cut off): its members that are silent that long too are dead. What this
        changes is the engines' (whose own deadline allows long generations): an engine that
        comes back finds itself replaced, and any result it writes is the same tokens."""
        if not hosts:
            return []
        now, decisions = time.time(), []
        deadline = self.deadlines.trainer.total_seconds()
        for member in self.alive():
            if (
                member.host in hosts
                and member.role == Role.ROLLOUT
                and now - self._liveness.last_beat(member, now) > deadline
            ):
                decisions += self.declare_dead(
                    member, f"its host's agent and it have been silent for more than {deadline:g} s"
                )
        return decisions

    def declare_dead(self, member: Member, reason: str) -> list[Decision]:
        member.state = MemberState.DEAD
        self._members.publish()
        if self._failed is not None:
            return []
        if member.role == Role.ROLLOUT:
            logger.warning("%s is dead (%s): the next weight sync skips it", member, reason)
            self.store.put(keys.engine_dead_since(member.rank), Stamp(at=time.time()))
            self.rollouts_lost.append(
                {"index": member.rank, "reason": reason, "at": time.time(), "replacement_started": False}
            )
            return [Decision(kind=DecisionKind.ROLLOUT_LOST, rank=member.rank, reason=reason, dead=member)]
        if member.role == Role.STANDBY:
            logger.warning("%s is dead (%s)", member, reason)
            self.standbys_replaced.append({"rank": member.rank, "reason": reason, "at": time.time()})
            return [Decision(kind=DecisionKind.STANDBY_LOST, rank=member.rank, reason=reason, dead=member)]
        if self.record.last() is None:
            return [
                self._fail(
                    member.rank,
                    restart=True,
                    reason=f"trainer {member.rank} died ({reason}) before the first global commit: "
                    "there is no state to resume from",
                )
            ]
        standby = self._members.live(Role.STANDBY, member.rank)
        if standby is None:
            return [
                self._fail(
                    member.rank,
                    state_lost=True,
                    reason=f"trainer {member.rank} died ({reason}) and has no standby: rank {member.rank} "
                    "was unprotected and its state is lost",
                )
            ]
        commit = self.record.last()
        assert commit is not None  # read above: the record's last commit never goes back to None
        if not self.record.standby_holds(member.rank, commit):
            return [
                self._fail(
                    member.rank,
                    state_lost=True,
                    reason=f"trainer {member.rank} died ({reason}) and its standby, {standby}, does not "
                    f"hold commit {commit} (it has not received the rank's state yet): rank "
                    f"{member.rank}'s state is lost",
                )
            ]
        self._promote(standby, reason)
        return [Decision(kind=DecisionKind.PROMOTED, rank=member.rank, reason=reason, dead=member)]

    def rollout_replacement_started(self, index: int) -> None:
        """The agent started a new engine for lost rollout ``index`` (it joins once up: a short
        job may end first)."""
        for lost in reversed(self.rollouts_lost):
            if lost["index"] == index:
                lost["replacement_started"] = True
                return

    def set_unprotected(self, rank: int, *, until_standby_joins: bool = False) -> None:
        """No standby protects ``rank`` now: its trainer acknowledges itself until a standby of it
        publishes its mirror (``until_standby_joins``: a replacement is starting; else none will come)."""
        if rank not in self.unprotected:
            self.unprotected_spans.append(
                {
                    "rank": rank,
                    "from_commit": self.record.last(),
                    "until_commit": None,
                    "from_at": time.time(),
                    "until_at": None,
                }
            )
            self._unprotected_reg[rank] = self.record.registration(rank)  # that standby protects no more
        self.unprotected.add(rank)
        self.record.set_unprotected(rank, True)
        if until_standby_joins:
            logger.warning("rank %d trains UNPROTECTED until its new standby is ready", rank)
        else:
            logger.error(
                "rank %d is UNPROTECTED: no standby is left for it; training goes on, but if its "
                "trainer dies the job fails",
                rank,
            )

    def finish(self) -> None:
        # The last trainers' done keys may have come after this loop's last poll (the
        # supervisor ends on all_done()): their members are done, not left alive.
        for member in self.alive():
            self._mark_done(member, fresh=True)
        self.store.put(keys.finished(), Flag())

    def _mark_done(self, member: Member, *, fresh: bool = False) -> bool:
        """Mark ``member`` done when it is a trainer whose rank finished (its last step
        committed: the rank's done key); True if it was. ``fresh``: look at the key itself,
        not only at what the last poll read (the keys are read when their counter moves)."""
        if member.role != Role.TRAINER:
            return False
        if member.rank not in self._done and fresh and self.store.has(keys.done(member.rank)):
            self._done.add(member.rank)
        if member.rank not in self._done:
            return False
        member.state = MemberState.DONE
        self._members.publish()
        return True

    def finished(self) -> bool:
        return self.store.has(keys.finished())

    def still_here(self, quiet: timedelta) -> list[Member]:
        """Members not declared dead whose heartbeat rose within ``quiet`` and whose exit no
        agent reported: not gone yet."""
        now = time.time()
        return [
            m
            for m in self.members
            if m.state in (MemberState.ALIVE, MemberState.DONE)
            and m.id not in self._exited
            and now - self._liveness.last_beat(m, now) < quiet.total_seconds()
        ]

    def all_done(self) -> bool:
        self._refresh_done()
        return len(self._done) == self.world_size

    def _refresh_done(self) -> None:
        """The ranks done, read again when their counter moved, and every ``_DONE_RECHECK``
        (the counter is an unsigned hint: a lost or forged one only delays this). A done key
        is mostly absent: on a TCPStore each is its own request, so a sweep reads
        ``_DONE_SWEEP`` ranks not known done per poll (a whole sweep in one poll held 1,024
        ranks' polls ~0.7 s, and a freeze's decision with them); on etcd the whole sweep is
        one range."""
        now = time.monotonic()
        if self._moved(keys.done_count()) or (
            not self._done_sweep and now - self._done_read_at > _DONE_RECHECK.total_seconds()
        ):
            self._done_sweep = [r for r in range(self.world_size) if r not in self._done]
            self._done_read_at = now
        # etcd reads absent keys together: the whole sweep in one range (32 requests a poll were 80 ms there).
        size = len(self._done_sweep) if self.store.reads_absent_together else _DONE_SWEEP
        batch, self._done_sweep = self._done_sweep[:size], self._done_sweep[size:]
        flags = self.store.get_many([keys.done(r) for r in batch])
        self._done |= {r for r, flag in zip(batch, flags, strict=False) if flag is not None}

    def members_for_placement(self) -> list[tuple[str, int, str, str]]:
        """The live members as (role, rank, host, domain): where agents place replacements (never in
        a trainer's domain)."""
        return [(m.role, m.rank, m.host, m.domain) for m in self.alive()]

    def alive(self, role: str | None = None) -> list[Member]:
        return self._members.alive(role)

    # --- deaths ---

    def _promote(self, standby: Member, reason: str) -> None:
        """Trainer ``standby.rank`` is dead: fix the commit to resume from, announce the
        next generation, promote the rank's standby."""
        rank = standby.rank
        decided = time.time()
        commit = self.record.last()
        g = self._generations.advance()
        if self.store.raw.check([self.store.full(keys.standby(rank))]):
            self.store.delete(keys.standby(rank))  # the promoted standby's address; its replacement publishes anew
        standby.role, standby.since, standby.generation = Role.TRAINER, decided, g
        self.store.put(
            keys.failover(g),
            FailoverRecord(generation=g, commit=commit if commit is not None else -1, rank=rank, member=standby.id),
        )
        self.store.put(keys.promote(rank), Promotion(rank=rank, generation=g, member=standby.id))
        self._generations.publish()  # last: whoever sees generation g finds its failover record
        standby.lost_base = self.record.lost_reports(rank)
        engine = self._members.live(Role.ROLLOUT, rank)
        if engine is not None and len(self.alive(Role.ROLLOUT)) == 1:  # the job cannot go on without it
            logger.warning("%s keeps serving beside trainer %d: it is the last engine", engine, rank)
        elif engine is not None:  # the standby's machine hosts rollout `rank`: its resources go to the trainer
            self.store.put(keys.rollout_stop(rank), Flag())
            # Its claims on shards are void from now on: the other engines take them.
            self.store.put(keys.engine_dead_since(rank), Stamp(at=time.time()))
            self.rollouts_retired.append(rank)
            logger.warning(
                "%s drains and stops: its machine now hosts trainer %d (%d rollouts left)",
                engine,
                rank,
                len(self.alive(Role.ROLLOUT)) - 1,
            )
        self._members.publish()
        self.failovers.append(
            FailoverTimeline(rank=rank, generation=g, commit=commit, reason=reason, decided_at=decided)
        )
        logger.warning(
            "trainer %d is dead (%s): generation %d resumes from commit %s with %s promoted",
            rank,
            reason,
            g,
            commit,
            standby,
        )

    def _fail(
        self, rank: int, reason: str, *, state_lost: bool = False, restart: bool = False, usage: bool = False
    ) -> Decision:
        self._failed = reason
        logger.error("the job failed: %s", reason)
        return Decision(
            kind=DecisionKind.FAILED, rank=rank, reason=reason, state_lost=state_lost, restart=restart, usage=usage
        )

    def request_export(self, directory: str) -> int | None:
        """Ask every standby to write its version of the last commit to ``directory``
        (an absolute path on the standbys' machines); returns that commit."""
        commit = self.record.last()
        if commit is not None:
            self.store.put(keys.export(), ExportRequest(commit=commit, directory=directory))
        return commit

    def exports(self, commit: int) -> dict[int, ExportOutcome]:
        """What each rank's standby answered so far to the request to export ``commit``
        (``request_export``): the file it wrote, or why it wrote none."""
        answers = self.store.get_many([keys.exported(r, commit) for r in range(self.world_size)])
        return {r: a for r, a in enumerate(answers) if a is not None}

    def _check_fatal(self) -> list[Decision]:
        """A role that hit an error no failover can fix (a layout mismatch) reports it here."""
        misplaced = self._admission.misplaced
        if misplaced is not None and self._failed is None:
            return [self._fail(misplaced[0], misplaced[1], usage=True)]
        fatal = self.store.get(keys.fatal()) if self._failed is None else None
        if fatal is not None:
            return [self._fail(-1, fatal.value)]
        return []

    def _moved(self, counter: str) -> bool:
        """Whether the plain counter ``counter`` moved since the last look (the first: yes)."""
        value = self.store.count(counter)
        moved = self._counters.get(counter) != value
        self._counters[counter] = value
        return moved

    # --- the timeline ---

    def fired(self, fault: str) -> float | None:
        """When an injected fault fired (its process records it just before dying)."""
        stamp = self.store.get(keys.killed(fault))
        return None if stamp is None else stamp.at

    def observe(self, failover: FailoverTimeline, faults: list[str]) -> None:
        """Fill in the failover's timeline from what the roles recorded."""
        g = failover.generation
        killed = [t for t in map(self.fired, faults) if t is not None]
        failover.killed_at = max((k for k in killed if k <= failover.decided_at), default=None)
        t0 = failover.killed_at or failover.decided_at
        failover.timeline_ms[Mark.DETECT] = (failover.decided_at - t0) * 1e3
        for name, key in (
            (Mark.PROMOTE, keys.restored(g)),
            (Mark.RECONNECT, keys.reconnected(g)),
            (Mark.RESUMED, keys.resumed(g)),
        ):
            stamp = self.store.get(key)
            if stamp is not None:
                failover.timeline_ms[name] = (stamp.at - t0) * 1e3
