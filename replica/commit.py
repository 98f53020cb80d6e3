"""The commit record: which step every rank's standby holds, in a
torch.distributed ``Store`` (the coordinator's, or one a test starts).

Keys, under ``{prefix}/``: ``standby/{rank}`` is where rank r's standby listens
(``backend address nonce``); ``ack/{rank}`` is the last step that standby verified;
``commit`` is the global commit, the minimum over ranks of ``ack``, only ever
raised (compare-and-set). The standby writing the last missing ack sees every
other ack (the store serializes requests) and raises the commit.
"""

from __future__ import annotations

import secrets
import time
from datetime import timedelta

import torch.distributed as dist

from replica.errors import CommitTimeoutError

__all__ = ["CommitRecord"]


class CommitRecord:
    def __init__(self, store: dist.Store, *, world_size: int, prefix: str = "replica"):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.store = store
        self.world_size = world_size
        self._prefix = prefix

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def publish_standby(self, rank: int, backend: str, address: str) -> None:
        # The nonce tells a replacement from its predecessor even when the OS hands it the same port.
        self.store.set(self._key("standby", rank), f"{backend} {address} {secrets.token_hex(8)}")

    def registration(self, rank: int) -> str | None:
        """Rank ``rank``'s standby registration as published (None before the first)."""
        key = self._key("standby", rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def standby(self, rank: int, timeout: timedelta) -> tuple[str, str, str]:
        """(backend, address, registration) of rank ``rank``'s standby; waits for it to publish.
        The registration tells one standby incarnation from the next."""
        key = self._key("standby", rank)
        try:
            self.store.wait([key], timeout)
        except RuntimeError as exc:  # the store says "Wait timeout" as a RuntimeError (DistStoreError)
            raise CommitTimeoutError(f"no standby of rank {rank} registered within {timeout}") from exc
        registration = self.store.get(key).decode()
        backend, address, _ = registration.split(" ")
        return backend, address, registration

    def acknowledge(self, rank: int, step: int) -> int | None:
        """Record that rank ``rank``'s standby holds ``step``; returns the global commit after."""
        self.store.set(self._key("ack", rank), str(step))
        keys = [self._key("ack", r) for r in range(self.world_size)]
        if not self.store.check(keys):
            return self.last()
        low = min(int(v) for v in self.store.multi_get(keys))
        key = self._key("commit")
        current = self.store.get(key) if self.store.check([key]) else b""
        while not current or int(current) < low:
            current = self.store.compare_set(key, current, str(low).encode())
        return int(current)

    def last(self) -> int | None:
        """The last global commit, or None before the first."""
        key = self._key("commit")
        return int(self.store.get(key)) if self.store.check([key]) else None

    def wait(self, step: int, timeout: timedelta, *, abort=None) -> int:
        """Block until the global commit is at least ``step``; ``abort()`` may raise to stop early."""
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 50e-6
        while True:
            last = self.last()
            if last is not None and last >= step:
                return last
            if abort is not None:
                abort()
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"step {step} was not globally committed within {timeout} (last commit: {last}); "
                    "a standby is missing or too slow")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
