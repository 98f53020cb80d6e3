"""What the coordinator keeps of each member and decides about them: ``Member`` (a role
that joined, its state and its beats), ``Decision`` (for the agent to act on),
``FailoverTimeline`` (for the report)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


from replica.roles.env import Role


__all__ = ["Decision", "DecisionKind", "FailoverTimeline", "Mark", "Member", "MemberState"]


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
