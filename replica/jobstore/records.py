"""The typed values of the job state: frozen records, one per kind of key
(``replica.jobstore.keys`` says which key holds which)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "Ack",
    "AckSummary",
    "AgentInfo",
    "AgentOrder",
    "Attempt",
    "Commit",
    "Epoch",
    "ExportOutcome",
    "ExportRequest",
    "ExportStatus",
    "Failover",
    "Flag",
    "FloorPart",
    "FloorVersion",
    "Generation",
    "Heartbeat",
    "JoinReply",
    "LivenessReply",
    "LostReports",
    "Number",
    "OrderKind",
    "ProcessLooks",
    "Promotion",
    "Registration",
    "Regroup",
    "RoleExit",
    "ServedJob",
    "Stamp",
    "Text",
]


@dataclass(kw_only=True, frozen=True, slots=True, order=True)
class Epoch:
    """One trainer incarnation: the process-group generation it trains in and its
    member id (its join number). Receivers refuse a stream whose epoch is not the
    rank's current one; acks carry it, and the commit counts only current ones."""

    generation: int
    member: int

    def __str__(self) -> str:
        return f"epoch {self.generation}/{self.member}"


@dataclass(kw_only=True, frozen=True, slots=True)
class Generation:
    """The current generation and the member id of each rank's trainer in it
    (-1 for a rank whose trainer has not joined yet). Written by the coordinator only."""

    number: int
    trainers: tuple[int, ...]

    def epoch(self, rank: int) -> Epoch | None:
        """The current epoch of ``rank``'s trainer (None while it has none)."""
        if not 0 <= rank < len(self.trainers) or self.trainers[rank] < 0:
            return None
        return Epoch(generation=self.number, member=self.trainers[rank])


@dataclass(kw_only=True, frozen=True, slots=True)
class Failover:
    """Generation ``generation`` resumes from ``commit`` (-1: none) after trainer
    ``rank`` died; ``member`` is its promoted standby."""

    generation: int
    commit: int
    rank: int
    member: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Promotion:
    rank: int
    generation: int
    member: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Commit:
    """The global commit: every rank's standby holds ``step``, acknowledged in ``generation``."""

    step: int
    generation: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Ack:
    """Rank ``rank``'s standby verified ``step``, streamed by the trainer of ``epoch``.
    ``holder`` is the nonce of that standby's registration ("" when an unprotected
    trainer acknowledged itself): the coordinator promotes only a standby that holds
    the commit."""

    rank: int
    step: int
    generation: int
    member: int
    holder: str = ""

    @property
    def epoch(self) -> Epoch:
        return Epoch(generation=self.generation, member=self.member)


@dataclass(kw_only=True, frozen=True, slots=True)
class AckSummary:
    """The least step the acks that count of group ``group``'s ranks reached, read in
    generation ``generation`` (-1: none published): what the commit's raise takes for
    the group instead of reading its ranks' acks (``replica.jobstore.commit``)."""

    group: int
    step: int
    generation: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Registration:
    """Where a listener (a standby's mirror, an engine's receiver) accepts
    connections; ``nonce`` tells a replacement from its predecessor."""

    backend: str
    address: str
    nonce: str
    # Where it also listens for a peer that its backend refuses (the shm backend's, for a
    # peer of another user or PID namespace); "" when nowhere else.
    fallback_backend: str = ""
    fallback_address: str = ""

    def endpoints(self) -> list[tuple[str, str]]:
        """(backend, address) pairs to connect to, in order: the backend, then any fallback."""
        fallback = [(self.fallback_backend, self.fallback_address)] if self.fallback_backend else []
        return [(self.backend, self.address), *fallback]

    def __str__(self) -> str:
        fallback = f" (or {self.fallback_backend} {self.fallback_address})" if self.fallback_backend else ""
        return f"{self.backend} {self.address}{fallback} {self.nonce}"


@dataclass(kw_only=True, frozen=True, slots=True)
class Heartbeat:
    """A member's liveness counter (the coordinator times it on its own clock)."""

    member: int
    beat: int


@dataclass(kw_only=True, frozen=True, slots=True)
class LivenessReply:
    """The coordinator's liveness endpoint's answer to beat ``beat`` of ``member``: the
    job's generation number then. Never in the store: a UDP datagram signed under
    ``keys.liveness_reply(member)`` (csrc/liveness.h writes it; the tests read it here)."""

    beat: int
    generation: int
    member: int


@dataclass(kw_only=True, frozen=True, slots=True)
class LostReports:
    """How many times rank ``rank``'s standby saw its trainer vanish without a goodbye."""

    rank: int
    count: int


@dataclass(kw_only=True, frozen=True, slots=True)
class JoinReply:
    """The coordinator's answer to join request ``seq`` (bound to its nonce)."""

    seq: int
    nonce: str
    admitted: bool
    reason: str
    generation: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Regroup:
    """Trainer ``rank`` found generation ``generation`` failed (a collective or
    rendezvous timed out) with no death announced: it asks for a fresh one."""

    rank: int
    generation: int


@dataclass(kw_only=True, frozen=True, slots=True)
class ExportRequest:
    """The job cannot go on (a rank's state is lost): every standby writes its version of
    ``commit`` to ``directory`` (``Mirror.export``) before the job ends."""

    commit: int
    directory: str


class ExportStatus(enum.StrEnum):
    WRITTEN = "written"  # the version is in the file ``path``
    FAILED = "failed"  # it could not be written: ``error`` says why


@dataclass(kw_only=True, frozen=True, slots=True)
class ExportOutcome:
    """What rank ``rank``'s role did with its version of ``step`` when asked to export it
    (``ExportRequest``): the file it wrote, or why it wrote none."""

    rank: int
    step: int
    status: ExportStatus
    path: str | None = None  # WRITTEN only
    error: str | None = None  # FAILED only

    def __post_init__(self) -> None:
        if (self.path is not None) != (self.status == ExportStatus.WRITTEN) or (self.error is not None) != (
            self.status == ExportStatus.FAILED
        ):
            raise ValueError(
                f"an export outcome {self.status} takes "
                f"{'a path' if self.status == ExportStatus.WRITTEN else 'an error'} and nothing else"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class FloorPart:
    """Rank ``rank``'s standby wrote its part of durable version ``step`` (``replica.mirror.floor``):
    the file's name in the version's folder, its size, and the combined digest of the buckets the
    file holds (``load_export`` checks the file against its own; the manifest names this one)."""

    rank: int
    step: int
    file: str
    nbytes: int
    digest: int
    fingerprint: str  # the rank's layout fingerprint


@dataclass(kw_only=True, frozen=True, slots=True)
class FloorVersion:
    """The manifest of a complete durable version: every rank's part is written (``FloorPart``'s
    fields of rank r at index r of each tuple). Only a version named by one is ever used (a
    half-written one never is)."""

    step: int
    directory: str
    files: tuple[str, ...]
    nbytes: tuple[int, ...]
    digests: tuple[int, ...]
    fingerprints: tuple[str, ...]
    written_at: float


@dataclass(kw_only=True, frozen=True, slots=True)
class Flag:
    """A fact that is simply true once written (finished, unprotected, done, stop)."""

    set: bool = True


@dataclass(kw_only=True, frozen=True, slots=True)
class AgentInfo:
    """Host agent ``index`` (``replica agent``): the host it runs on, its address and its
    failure domain (``--domain``; "": the host)."""

    index: int
    host: str
    address: str
    pid: int
    domain: str = ""


@dataclass(kw_only=True, frozen=True, slots=True)
class ProcessLooks:
    """A host agent's verdicts on the role processes it runs, from its own looks at them
    (``replica.roles.probe``: gone, dead, stalled), written with its beats: the coordinator's
    second channel for a member of that host silent past its deadline. Parallel tuples, one
    entry per process."""

    pids: tuple[int, ...]
    verdicts: tuple[str, ...]
    whys: tuple[str, ...]


@dataclass(kw_only=True, frozen=True, slots=True)
class RoleExit:
    """A role process a host agent started exited (``code``: its exit status, -N for signal N;
    ``spare``: the index of the spare standby it was, not bound to a rank when started, or -1)."""

    host: str
    pid: int
    code: int
    spare: int = -1


@dataclass(kw_only=True, frozen=True, slots=True)
class Attempt:
    """The job's attempt in progress (``keys.attempt``, at the job's own prefix): attempt ``number``
    (its state under ``attempt_prefix``) started again from the durable floor's version of
    ``step`` in ``directory`` after a rank lost every copy of its state (``reason``: how the
    attempt before said so); ``fired``: the injected faults that fired in the attempts before it
    (not injected again)."""

    number: int
    step: int
    directory: str
    fired: tuple[str, ...] = ()
    reason: str = ""


@dataclass(kw_only=True, frozen=True, slots=True)
class ServedJob:
    """A job for the host agents that serve job after job (``replica agent --serve``;
    ``keys.served_job``, at the job's own prefix): ``script`` (a path that holds on every host)
    run with ``args`` in every role, ``environ`` the roles' settings (``job_environ``'s, without
    what each agent sets itself); ``id``: new for each job, so an agent serves a job once."""

    id: str
    script: str
    args: tuple[str, ...] = ()
    environ: dict = field(default_factory=dict)


class OrderKind(enum.StrEnum):
    START = "start"  # start a role process (role, rank)
    KILL = "kill"  # make sure a process declared dead is dead (pid)


@dataclass(kw_only=True, frozen=True, slots=True)
class AgentOrder:
    """What the coordinator asks a host agent to do."""

    kind: OrderKind
    role: str = ""
    rank: int = -1
    pid: int = 0
    spare: int = -1  # START: a spare standby of this index (no rank yet: roles/spares.py)


@dataclass(kw_only=True, frozen=True, slots=True)
class Stamp:
    """When something happened (``time.time()`` of the writer)."""

    at: float


@dataclass(kw_only=True, frozen=True, slots=True)
class Number:
    value: int


@dataclass(kw_only=True, frozen=True, slots=True)
class Text:
    value: str
