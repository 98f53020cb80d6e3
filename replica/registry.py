"""Where a listener (a standby's mirror, a rollout engine's weight receiver)
publishes itself in the job store: ``backend address nonce`` under one key. The
nonce tells a replacement from its predecessor even when the OS hands it the
same port; a connector keeps the registration it connected to and reconnects
when it changes."""

from __future__ import annotations

import secrets
from datetime import timedelta

import torch.distributed as dist

from replica.errors import CommitTimeoutError

__all__ = ["publish", "registration", "wait_registration"]


def publish(store: dist.Store, key: str, backend: str, address: str) -> str:
    value = f"{backend} {address} {secrets.token_hex(8)}"
    store.set(key, value)
    return value


def registration(store: dist.Store, key: str) -> str | None:
    """The registration under ``key`` as published (None before the first)."""
    return store.get(key).decode() if store.check([key]) else None


def wait_registration(store: dist.Store, key: str, timeout: timedelta, what: str) -> tuple[str, str, str]:
    """(backend, address, registration) under ``key``; waits up to ``timeout`` for it."""
    try:
        store.wait([key], timeout)
    except RuntimeError as exc:  # the store says "Wait timeout" as a RuntimeError (DistStoreError)
        raise CommitTimeoutError(f"no {what} registered within {timeout}") from exc
    value = store.get(key).decode()
    backend, address, _ = value.split(" ")
    return backend, address, value
