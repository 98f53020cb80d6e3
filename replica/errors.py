"""Typed errors shared by every layer of replica (transport, replica, roles)."""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BucketCorruptedError",
    "CommitTimeoutError",
    "JoinRefusedError",
    "LayoutMismatchError",
    "PeerDisconnectedError",
    "ReplicaError",
    "StandbyLostError",
    "TransferTimeoutError",
    "TransportError",
]


class ReplicaError(RuntimeError):
    """Base class of every error replica raises on purpose."""


class TransportError(ReplicaError):
    """A transfer between two processes failed."""


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


class TransferTimeoutError(TransportError, TimeoutError):
    """A blocking transport call did not finish within its deadline."""


class AuthenticationError(ReplicaError):
    """A peer presented a missing or wrong job token."""


class JoinRefusedError(ReplicaError):
    """The coordinator refused this process's join (wrong token, rank taken, job over)."""


class LayoutMismatchError(ReplicaError):
    """A mirrored state does not fit the model, optimizer or world it is applied to."""


class CommitTimeoutError(ReplicaError, TimeoutError):
    """A step was not globally committed in time: some rank's standby is missing or slow."""


class StandbyLostError(ReplicaError):
    """This rank's standby is gone or refused the mirror: the rank is unprotected
    until a standby is attached again."""
