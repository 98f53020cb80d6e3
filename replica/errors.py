"""Typed errors shared by every layer of replica (transport, replica, roles, replica.ray): each
is defined here, and nowhere else."""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BucketCorruptedError",
    "CommitTimeoutError",
    "DivergenceError",
    "EngineWorkersDisagreeError",
    "EtcdError",
    "FencedError",
    "InterfaceNotFoundError",
    "JobLifecycleError",
    "JobStateError",
    "JobStoreAddressError",
    "JobStoreInUseError",
    "JobWaitTimeoutError",
    "JoinRefusedError",
    "LayoutMismatchError",
    "MainThreadError",
    "MemoryPinningError",
    "PeerDisconnectedError",
    "PlacementError",
    "ReplicaError",
    "ResendsExhaustedError",
    "RoleEnvironmentError",
    "SharedMemoryUnavailableError",
    "SnapshotCorruptedError",
    "StandbyLostError",
    "StoreWaitTimeoutError",
    "TransferTimeoutError",
    "TransportError",
    "VersionNotReadyError",
    "WeightTransferNotStartedError",
    "WeightsTimeoutError",
]


class ReplicaError(RuntimeError):
    """Base class of every error replica raises on purpose."""


class TransportError(ReplicaError):
    """A transfer between two processes failed."""


class ResendsExhaustedError(TransportError):
    """The receiver still refused ``buckets`` of version ``step`` after ``Config.max_resends``
    rounds of sending them again: their bytes may have changed in the sender's memory."""

    def __init__(self, message: str, *, step: int, buckets: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.buckets = buckets


class BucketCorruptedError(TransportError):
    """A received bucket's digest does not match the one its sender computed.

    The receive buffer holds bad bytes; the sender may send the bucket again.
    """

    def __init__(self, message: str, *, step: int, bucket: int, tag: int) -> None:
        super().__init__(message)
        self.step = step
        self.bucket = bucket
        self.tag = tag


class PeerDisconnectedError(TransportError):
    """The remote process closed the connection or died.

    ``graceful`` is True when the peer said goodbye (closed on purpose) and False
    when its end simply vanished, as when the process is killed or its machine is
    lost: the coordinator counts only the second kind as evidence of a death.
    """

    def __init__(self, message: str, *, graceful: bool = False) -> None:
        super().__init__(message)
        self.graceful = graceful


class SharedMemoryUnavailableError(TransportError):
    """Two processes cannot map each other's shared memory (another user, another PID
    namespace: a peer in another container), so the shm backend refused their
    connection on both sides. A connector that has another way to the peer (the
    listener's fallback backend) takes it."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A blocking transport call did not finish within its deadline."""


class MemoryPinningError(ReplicaError):
    """CUDA would not page-lock (pin) a region of shared memory: no GPU is visible, or the
    process is out of lockable memory."""


class AuthenticationError(ReplicaError):
    """A peer presented a missing or wrong job token.

    Not a TransportError on purpose: trying again will not fix the token. A
    handshake cut short by EOF or its deadline (a peer that died or stalled)
    raises PeerDisconnectedError or TransferTimeoutError instead, which callers
    may retry."""


class JoinRefusedError(ReplicaError):
    """The coordinator refused this process's join (wrong token, rank taken, job over)."""


class LayoutMismatchError(ReplicaError):
    """A mirrored state does not fit the model, optimizer or world it is applied to."""


class SnapshotCorruptedError(ReplicaError):
    """A held version (a standby's, or a trainer's own snapshot) no longer matches
    the per-bucket digests taken when it was complete: its memory changed at rest.
    It is never restored, exported or sent. ``buckets`` are the bad indices."""

    def __init__(self, message: str, *, rank: int, step: int | None, buckets: tuple[int, ...]) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.buckets = buckets


class StoreWaitTimeoutError(ReplicaError, TimeoutError):
    """A wait on the job store passed its deadline: what it waited for was never written."""


class CommitTimeoutError(StoreWaitTimeoutError):
    """A step was not globally committed in time: some rank's standby is missing or slow."""


class StandbyLostError(ReplicaError):
    """This rank's standby is gone or refused the mirror: the rank is unprotected
    until a standby is attached again."""


class JobStateError(ReplicaError):
    """A value in the job store is unsigned, forged or malformed (it is ignored)."""


class EtcdError(ReplicaError):
    """etcd refused a request (permission, bad credentials, a malformed request)."""


class JobStoreInUseError(ReplicaError):
    """A launcher was pointed at a job store that holds another job, or that another
    coordinator leads: each job takes a namespace of its own (etcd://HOSTS/NAMESPACE)."""


class JobStoreAddressError(ReplicaError):
    """The coordinator cannot host the job store at the address it was given: the port is
    taken (another coordinator may run there), or the host is none of this machine's."""


class DivergenceError(ReplicaError):
    """A step redone after a failover did not reproduce what it computed before (its loss
    or its state): the run is no longer the failure-free one (``replica launch --strict``)."""


class FencedError(ReplicaError):
    """This process's epoch was superseded: the coordinator declared it dead and
    another process holds its rank now. It must stop."""


class VersionNotReadyError(ReplicaError):
    """The weight version an engine was asked to serve has not arrived complete (or a newer
    one displaced it): the engine keeps serving the one it had."""


class WeightsTimeoutError(ReplicaError, TimeoutError):
    """An engine waited past its deadline for a weight version to arrive (it serves the one
    it had); a TimeoutError, as the engine's ``wait`` promises."""


class WeightTransferNotStartedError(ReplicaError):
    """A vLLM engine was asked about replica's weight transfer before it has one: it was
    started without ``EngineWeights.ENGINE_ARGS``, or ``init_weight_transfer_engine`` was
    not called yet."""


class EngineWorkersDisagreeError(ReplicaError):
    """The tensor-parallel workers of one vLLM engine answered a query differently (they
    hold different weight versions), where they apply every version together."""


class RoleEnvironmentError(ReplicaError):
    """This process's environment does not describe a role (no role or token, or a role
    that does not exist): role processes are started by ``replica launch``."""


class MainThreadError(ReplicaError):
    """A call that must run on the process's main thread ran on another: a child's
    PR_SET_PDEATHSIG fires when the thread that forked it exits, not the process."""


class InterfaceNotFoundError(ReplicaError):
    """No network interface of this host holds the address a host agent was given (a
    partition fault has no link to take down)."""


class PlacementError(ReplicaError):
    """The job's roles cannot be placed on the Ray cluster (within the placement deadline)."""


class JobLifecycleError(ReplicaError):
    """A ``RayJob`` was asked for something out of order: started twice, or waited for (or
    asked for rollouts) before ``start()``."""


class JobWaitTimeoutError(ReplicaError, TimeoutError):
    """``RayJob.wait`` passed its timeout with the job still running (the job goes on)."""
