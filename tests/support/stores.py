"""A job-store client that counts what it asks of its store (the control plane's cost)."""

from __future__ import annotations

import threading
from collections import Counter

import torch

__all__ = ["CountingStore"]


class CountingStore:
    """A ``torch.distributed`` store client (``inner``) that counts what it asks of the
    store: requests by method (``requests``), keys named (``keys``) and bytes sent and
    received (``bytes``), for measuring the control plane's cost. ``JobStore`` takes it
    where it takes a store (it only calls these methods); its ``clone()`` (a thread's own
    connection, ``JobStore.own``) counts into the same totals."""

    def __init__(self, inner, *, _shared: CountingStore | None = None):
        self.inner = inner
        self.clone_per_thread = isinstance(inner, torch.distributed.TCPStore)
        self._tally = self if _shared is None else _shared._tally
        if _shared is None:
            self.requests: Counter[str] = Counter()
            self.keys = 0
            self.bytes = 0
            self.calls: list[tuple[str, int]] = []  # (method, keys named), in order
            self._lock = threading.Lock()

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone(), _shared=self)

    def reset(self) -> None:
        tally = self._tally
        with tally._lock:
            tally.requests.clear()
            tally.keys = tally.bytes = 0
            tally.calls.clear()

    @property
    def total(self) -> int:
        return sum(self._tally.requests.values())

    def _count(self, method: str, keys: list[str], nbytes: int) -> None:
        tally = self._tally
        with tally._lock:
            tally.requests[method] += 1
            tally.keys += len(keys)
            tally.bytes += nbytes + sum(len(k) for k in keys)
            tally.calls.append((method, len(keys)))

    def set(self, key: str, value) -> None:
        self._count("set", [key], len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", [key], len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self._count("multi_get", keys, sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values) -> None:
        self._count("multi_set", keys, sum(len(v) for v in values))
        self.inner.multi_set(keys, values)

    def add(self, key: str, amount: int) -> int:
        self._count("add", [key], 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", [key], len(expected) + len(desired) + len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self._count("check", keys, 0)
        return self.inner.check(keys)

    def wait(self, keys: list[str], *args) -> None:
        self._count("wait", keys, 0)
        self.inner.wait(keys, *args)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key", [key], 0)
        return self.inner.delete_key(key)
