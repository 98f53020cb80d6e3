"""A bounded, thread-safe map that forgets the least recently used entries: what the job
store's clients remember to save a round trip or a verification (values verified,
counters' last values, prefixes' sizes, values already logged as bad)."""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar, overload

__all__ = ["BoundedMap"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """At most ``limit`` entries; reading an entry makes it the most recently used, and
    putting one past the limit forgets the least recently used. Memory stays bounded
    whatever keys a long job goes through; a forgotten entry only costs the work it saved."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a bounded map holds at least one entry, not {limit}")
        self.limit = limit
        self._entries: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: V) -> V: ...

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            value = self._entries.get(key, default)
            if key in self._entries:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._put(key, value)

    def first_time(self, key: K) -> bool:
        """Remember ``key``; True when it was not remembered already (log once per key)."""
        with self._lock:
            known = key in self._entries
            self._put(key, None)  # type: ignore[arg-type]
            return not known

    def _put(self, key: K, value: V) -> None:  # under _lock
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
