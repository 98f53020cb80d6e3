"""A stand-in rollout engine for the tests and the rollout benchmark: the real serving loop
(``replica.roles.rollout_engine.serve_requests``), desks and job store, with an engine that
makes each completion from its prompt and seed instead of a model (where a test or the
benchmark uses it, it says so); and a record of the largest value written to a job store."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

from replica.errors import WeightsTimeoutError
from replica.jobstore import JobStore

__all__ = ["StandInEngine", "largest_store_value", "stand_in_completion"]


def stand_in_completion(prompt: Sequence[int], seed: int, max_tokens: int) -> list[int]:
    """What the stand-in makes of ``prompt`` with ``seed``: the same on every engine."""
    base = (sum(prompt) * 7919 + seed * 104729) % 50_000
    return [(base + 31 * j) % 50_000 for j in range(max_tokens)]


class StandInEngine:
    """Serves weight version ``version`` (``set_version`` moves it) and makes completions
    with ``stand_in_completion``, at ``tokens_per_s`` (None: at once)."""

    def __init__(self, *, version: int = 1, tokens_per_s: float | None = None):
        self.version = version
        self.tokens_per_s = tokens_per_s
        self.served_epoch: int | None = 0
        self.generated = 0  # tokens made
        self.make_s = 0.0  # seconds spent making them (not sleeping to the rate)
        self._changed = threading.Condition()

    def set_version(self, version: int) -> None:
        with self._changed:
            self.version = version
            self._changed.notify_all()

    def update(self) -> None:
        pass

    def wait(self, version: int, timeout: timedelta) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: self.version >= version, timeout=timeout.total_seconds()):
                raise WeightsTimeoutError(f"version {version} did not arrive")
            return self.version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, seeds: Sequence[int]) -> list[list[int]]:
        start = time.perf_counter()
        out = [stand_in_completion(p, s, sampling["max_tokens"]) for p, s in zip(prompts, seeds, strict=False)]
        tokens = sum(map(len, out))
        made = time.perf_counter() - start
        self.make_s += made
        if self.tokens_per_s:  # the making counts toward the set rate
            time.sleep(max(0.0, tokens / self.tokens_per_s - made))
        self.generated += tokens
        return out

    def close(self) -> None:
        pass


@contextlib.contextmanager
def largest_store_value() -> Iterator[list[int]]:
    """While open, ``[n]``: the largest signed value any JobStore of this process wrote."""
    seen = [0]
    sign = JobStore.sign

    def recording(self, key, value):
        raw = sign(self, key, value)
        seen[0] = max(seen[0], len(raw))
        return raw

    JobStore.sign = recording
    try:
        yield seen
    finally:
        JobStore.sign = sign
