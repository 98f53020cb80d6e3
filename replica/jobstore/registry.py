"""Where a listener (a standby's mirror, a rollout engine's weight receiver)
publishes itself in the job store: a signed ``Registration`` (backend, address,
nonce) under its schema key. The nonce tells a replacement from its predecessor
even when the OS hands it the same port; a connector keeps the registration it
connected to and reconnects when it changes."""

from __future__ import annotations

import secrets
from datetime import timedelta

from replica.errors import CommitTimeoutError, StoreWaitTimeoutError
from replica.jobstore import JobStore, Key, Registration

__all__ = ["publish", "registration", "wait_registration"]


def publish(
    store: JobStore, key: Key[Registration], backend: str, address: str, fallback: tuple[str, str] | None = None
) -> Registration:
    """Publish a listener at ``address`` on ``backend`` and, when given, its ``fallback``
    (backend, address) for peers the first refuses (``Listener.fallback``)."""
    fallback_backend, fallback_address = fallback or ("", "")
    value = Registration(
        backend=backend,
        address=address,
        nonce=secrets.token_hex(8),
        fallback_backend=fallback_backend,
        fallback_address=fallback_address,
    )
    store.put(key, value)
    return value


def registration(store: JobStore, key: Key[Registration]) -> Registration | None:
    """The registration under ``key`` as published (None before the first, or if forged)."""
    return store.get(key)


def wait_registration(store: JobStore, key: Key[Registration], timeout: timedelta, what: str) -> Registration:
    """The registration under ``key``; waits up to ``timeout`` for one."""
    try:
        return store.wait(key, timeout, what=f"{what} registered")
    except StoreWaitTimeoutError as exc:
        raise CommitTimeoutError(str(exc)) from exc
