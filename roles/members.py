"""What the coordinator keeps of each member and decides about them: ``Member`` (a role
that joined, its state and its beats), ``Members`` (the membership table),
``Decision`` (for the agent to act on), ``FailoverTimeline`` (for the report)."""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from replica.jobstore import JobStore, Text, keys
from replica.roles.env import Role

__all__ = ["Decision", "DecisionKind", "FailoverTimeline", "Mark", "Member", "MemberState", "Members"]


class MemberState(enum.StrEnum):
    ALIVE = "alive"
    DONE = "done"  # finished its work (a trainer's last step committed, a rollout told to stop)
    DEAD = "dead"  # declared dead (exited, lost, or silent past its deadline)


class DecisionKind(enum.StrEnum):
    PROMOTED = "promoted"  # the rank's standby is its trainer now: start a new standby
    STANDBY_LOST = "standby_lost"  # start a replacement standby
    ROLLOUT_LOST = "rollout_lost"  # start a replacement engine
    FAILED = "failed"  # the job cannot go on


@dataclass(kw_only=True, slots=True)
class Member:
    """A row of the membership table."""

    id: int
    role: Role
    rank: int
    host: str
    pid: int
    generation: int
    domain: str = ""  # its failure domain (REPLICA_DOMAIN, else its host)
    joined_at: float
    since: float  # when it took its current role (a promoted standby's promotion)
    state: MemberState = MemberState.ALIVE
    # Liveness, on the coordinator's clock only (roles on other machines need not agree on time):
    beats: int = field(default=0, repr=False)  # the highest verified heartbeat counter read
    beat_at: float = field(default=0.0, repr=False)  # when it last changed
    checked_at: float = field(default=0.0, repr=False)  # when its beats were last read outside a scan of all
    lost_base: int = field(default=0, repr=False)  # transport reports of its rank before it took its role
    #: The longest heartbeat silence seen while it was alive (what its deadline is measured against).
    max_silence_s: float = 0.0

    def __str__(self) -> str:
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host})"


class Members:
    """The membership table: owns every member that joined (``rows``, in the order they joined,
    the dead kept) and the table's copy in the store (``keys.members()``, for people and reports).
    It decides nothing: who is admitted, dead or promoted is the coordinator's (and its
    ``Admission``'s and ``Liveness``'s) to say; this only finds members and writes the table."""

    def __init__(self, store: JobStore):
        self.rows: list[Member] = []
        self._store = store
        self._deferred = self._dirty = False

    def alive(self, role: str | None = None) -> list[Member]:
        return [m for m in self.rows if m.state == MemberState.ALIVE and role in (None, m.role)]

    def live(self, role: str, rank: int) -> Member | None:
        """The live ``role`` of ``rank`` (None: none)."""
        return next((m for m in self.alive(role) if m.rank == rank), None)

    def table(self) -> list[dict]:
        """The membership table: role, rank, host, domain, pid, generation and state of every member."""
        shown = ("id", "role", "rank", "host", "domain", "pid", "generation", "state", "max_silence_s")
        return [
            {k: round(v, 3) if k == "max_silence_s" else v for k, v in asdict(m).items() if k in shown}
            for m in self.rows
        ]

    def publish(self) -> None:
        """Write the table to the store (within ``batch``: once, at its end)."""
        if self._deferred:
            self._dirty = True
            return
        self._store.put(keys.members(), Text(value=json.dumps(self.table())))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Write the membership table (O(N) bytes) once, after the block, however many
        members it changed: a poll that declared 9 members dead at 1,024 ranks wrote it 9 times
        (0.8 s, and every decision of the poll that late)."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False
            if self._dirty:
                self._dirty = False
                self.publish()

    def restore(self, table: Text | None, *, now: float, lost: dict[int, int]) -> None:
        """Rebuild the rows from the table a predecessor published (``table``): every live member's
        deadline runs from ``now``; ``lost``: each rank's transport reports so far."""
        for row in json.loads(table.value) if table is not None else []:
            self.rows.append(
                Member(
                    id=int(row["id"]),
                    role=Role(row["role"]),
                    rank=int(row["rank"]),
                    host=str(row["host"]),
                    domain=str(row.get("domain") or row["host"]),
                    pid=int(row["pid"]),
                    generation=int(row["generation"]),
                    joined_at=now,
                    since=now,
                    state=MemberState(row["state"]),
                    beat_at=now,
                    lost_base=lost.get(int(row["rank"]), 0),
                    max_silence_s=float(row.get("max_silence_s", 0.0)),
                )
            )


class Mark(enum.StrEnum):
    """The marks of a failover's timeline, in order (ms after the kill, or the decision)."""

    DETECT = "detect"  # the coordinator declared the trainer dead
    PROMOTE = "promote"  # the promoted standby restored the commit
    RECONNECT = "reconnect"  # the promoted standby is in the new generation's process group
    RESUMED = "resumed"  # the first step after the failover is done


@dataclass(kw_only=True, slots=True)
class FailoverTimeline:
    """One failover as the coordinator saw it: the rank, the generation and commit it
    resumed from, why, and when each of its phases happened (for the report)."""

    rank: int
    generation: int
    commit: int | None
    reason: str
    decided_at: float
    killed_at: float | None = None
    timeline_ms: dict[Mark, float] = field(default_factory=dict)


@dataclass(kw_only=True, frozen=True, slots=True)
class Decision:
    """What the coordinator decided, for the agent to act on (``DecisionKind``)."""

    kind: DecisionKind
    rank: int
    reason: str
    dead: Member | None = None
    #: ``failed`` because rank's state is lost: the surviving standbys can still export the commit.
    state_lost: bool = False
    #: ``failed`` before the first global commit: nothing is lost by starting the job again.
    restart: bool = False
    #: ``failed`` before the first global commit because the job is set up wrong (a standby in
    #: its trainer's failure domain): the command's exit code is ``ExitCode.USAGE``.
    usage: bool = False
