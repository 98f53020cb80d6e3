"""The commit record: which step every rank's standby holds, in a
torch.distributed ``Store`` (the coordinator's, or one a test starts).

Keys, under ``{prefix}/``: ``standby/{rank}`` is where rank r's standby listens
(``backend address nonce``); ``ack/{rank}`` is the last step that standby verified;
``commit`` is the global commit, the minimum over ranks of ``ack``, only ever
raised (compare-and-set). The standby writing the last missing ack sees every
other ack (the store serializes requests) and raises the commit.

Two more keys carry what the coordinator decides from: ``lost/{rank}`` counts the
times rank r's standby saw its trainer vanish (a transport-level sign of death), and
``unprotected/{rank}`` says no standby will come for rank r, so its trainer
acknowledges its own snapshots (survivors can still roll back to every commit;
the rank itself cannot be recovered if it dies).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from replica.errors import CommitTimeoutError
from replica.registry import publish, registration, wait_registration

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
        publish(self.store, self._key("standby", rank), backend, address)

    def registration(self, rank: int) -> str | None:
        """Rank ``rank``'s standby registration as published (None before the first)."""
        return registration(self.store, self._key("standby", rank))

    def standby(self, rank: int, timeout: timedelta) -> tuple[str, str, str]:
        """(backend, address, registration) of rank ``rank``'s standby; waits for it to publish.
        The registration tells one standby incarnation from the next."""
        return wait_registration(self.store, self._key("standby", rank), timeout, f"standby of rank {rank}")

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

    def report_lost(self, rank: int) -> None:
        """Rank ``rank``'s standby saw its trainer's connection vanish without a goodbye."""
        self.store.add(self._key("lost", rank), 1)

    def lost_reports(self, rank: int) -> int:
        """How many times rank ``rank``'s trainer was reported vanished (a counter, so
        readers on other machines need no common clock)."""
        return self.store.add(self._key("lost", rank), 0)

    def set_unprotected(self, rank: int, unprotected: bool) -> None:
        key = self._key("unprotected", rank)
        if unprotected:
            self.store.set(key, "1")
        elif self.store.check([key]):
            self.store.delete_key(key)

    def unprotected(self, rank: int) -> bool:
        """True when no standby will come for rank ``rank`` (its trainer acknowledges itself)."""
        return self.store.check([self._key("unprotected", rank)])

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
