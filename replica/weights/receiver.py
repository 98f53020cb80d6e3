"""Weight sync's receiver (``WeightReceiver``, in an engine's process): versions received
into staging, verified, and handed to the engine only whole (the package's docstring has
the protocol)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import Store

from replica.config import Config
from replica.errors import TransportError
from replica.jobstore import Epoch, JobStore, Number, keys
from replica.jobstore.commit import EpochRecord
from replica.jobstore.registry import publish
from replica.session.bucketstream import accept_sender, receive_versions
from replica.session.listener import Listener
from replica.session.protocol import Begin, answer_layout, fingerprint_int
from replica.state.layout import StateLayout, dtype_of
from replica.transport import Connection, MemoryKind
from replica.weights.layout import named_views, tensor_buckets
from replica.weights.pagebuffer import PageBuffer

__all__ = ["ReceiverStats", "WeightReceiver"]

logger = logging.getLogger(__name__)


_EPOCHS_KEPT = 8  # a receiver remembers the sender epoch of this many recent versions


def _consumable_views(page: PageBuffer, layout: StateLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_views`` whose pages go back to the OS once a loader is done with them (PageBuffer)."""
    entries = list(layout.entries)
    spans = page.consumable((e.offset, e.offset + e.nbytes) for e in entries)
    for e, view in zip(entries, spans, strict=False):
        yield e.name, view.view(dtype_of(e.dtype)).view(e.shape)


@dataclass(kw_only=True, slots=True)
class ReceiverStats:
    bytes_received: int = 0
    corrupted_buckets: int = 0
    fenced: int = 0  # senders refused for their epoch (a zombie leader), at connect or at a version
    prestaged: int = 0  # versions received into buffers posted before their BEGIN (none here)


class WeightReceiver(Listener):
    """The engine side: listens, receives versions, verifies them, and hands the
    engine complete versions only (``apply``). It accepts only a sender of the
    current epoch of trainer rank ``leader`` (the ``WeightSync`` leader) as the
    coordinator's generation record names it; without a record, any."""

    def __init__(
        self,
        *,
        index: int,
        store: Store | JobStore,
        config: Config,
        expect: Callable[[StateLayout], None] | None = None,
        on_ready: Callable[[int], None] | None = None,
        leader: int = 0,
        buffers: int = 2,
        on_receiving: Callable[[int], None] | None = None,
    ):
        if buffers not in (1, 2):
            raise ValueError(f"buffers is 1 or 2, got {buffers}")
        super().__init__(config=config, memory=MemoryKind.HOST, name=f"engine {index}")
        self.index = index
        self.leader = leader
        self.store = JobStore.of(store, token=config.token, prefix=config.store_prefix)
        self.epochs = EpochRecord(self.store)
        self.stats = ReceiverStats()
        self._expect = expect
        # 2: a version arrives while the last one is ready (applied when the engine likes); 1: one
        # buffer, the model's size (a version that starts arriving displaces an unapplied ready one).
        self._buffers = buffers
        self._on_ready = on_ready  # called (from the receiving thread) when a version is complete
        self._on_receiving = on_receiving  # called (from the receiving thread) when a version starts to arrive
        self._page: PageBuffer | None = None  # the one buffer (buffers=1): its pages can go back to the OS
        self._layout: StateLayout | None = None
        self._staging: torch.Tensor | None = None
        self._ready: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # a third buffer, used while the ready one is held
        self._ready_step: int | None = None
        self._held_buffer: torch.Tensor | None = None
        self._receiving = threading.Lock()  # one session at a time writes the staging buffer
        self.version: int | None = None  # the version the engine serves (applied)
        self.served_epoch: Epoch | None = None  # the epoch of the leader that sent it
        self._epochs: dict[int, Epoch] = {}  # the sender's epoch of each recent complete version
        self._sender: Connection | None = None  # the current sender's connection
        self.registration = publish(self.store, keys.engine(index), self.backend, self.address, self.fallback)
        self._start()

    def ready(self) -> int | None:
        """The newest complete version received, applied or not."""
        with self._cond:
            return self._ready_step

    def prefault(self) -> bool:
        """With one buffer whose memory went back to the OS: take it again now, off the
        receive's path (each page faulted in by the transfer costs it time). Contents kept;
        False where the kernel cannot (the receive then faults the pages in)."""
        page = self._page
        return page is not None and page.populate()

    @property
    def released_bytes(self) -> int:
        """Of the version last held with ``consume``, the bytes whose memory went back to the OS."""
        return 0 if self._page is None else self._page.dropped_bytes

    def wait_ready(self, step: int, timeout: timedelta) -> bool:
        """Block until a complete version >= ``step`` has been received."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._ready_step is not None and self._ready_step >= step, timeout.total_seconds()
            )

    @contextmanager
    def hold(
        self, newer_than: int | None = None, *, consume: bool = False
    ) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]] | None]:
        """The newest complete version newer than ``newer_than`` (and than the
        served one) as ``(step, views)``, or None. Its buffer stays untouched
        while held: with two buffers, a version completing meanwhile goes to a
        spare buffer, so holding never delays the sender; with one, the next
        version waits. ``consume`` (one buffer only): each view's memory goes back
        to the OS once the caller is done with it (``PageBuffer``), so the version
        is no longer ready after the hold."""
        if consume and self._buffers != 1:
            raise ValueError("consume needs a receiver with one buffer")
        with self._cond:
            step = self._ready_step
            floor = max(v for v in (newer_than, self.version, -1) if v is not None)
            if step is None or step <= floor:
                got = None
            else:
                ready, layout, page = self._ready, self._layout, self._page
                assert ready is not None and layout is not None  # a ready step: its layout came first
                self._held_buffer = ready
                if consume:
                    assert page is not None  # one buffer (checked above): a PageBuffer
                    views = _consumable_views(page, layout)
                else:
                    views = named_views(ready, layout)
                got = (step, views)
        try:
            yield got
        finally:
            if got is not None:
                with self._cond:
                    self._held_buffer = None
                    if consume and self._ready_step == step:
                        self._ready, self._ready_step = None, None  # its bytes are gone
                    self._cond.notify_all()

    def served(self, step: int) -> None:
        """Record that the engine now serves version ``step`` (and report it in the store)."""
        with self._cond:
            self.version, self.served_epoch = step, self._epochs.get(step)
        self.store.put(keys.engine_version(self.index), Number(value=step))
        logger.info("[engine %d] serving weights of step %d (sent by %s)", self.index, step, self.served_epoch)

    def apply(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None]) -> int | None:
        """If a newer complete version is ready, call ``load`` with an iterator over
        ``(name, tensor)`` views of it (valid during the call), then record it as
        the served version. Returns the version applied, or None if none was new."""
        with self.hold() as got:
            if got is None:
                return None
            step, views = got
            load(views)
        self.served(step)
        return step

    def _held(self) -> str:
        return f"; serving version {self.version}"

    def _current_epoch(self) -> Epoch | None:
        return self.epochs.current_epoch(self.leader)

    def _session(self, conn: Connection) -> None:
        timeout = self.config.timeout
        _, layout = accept_sender(
            conn, current_epoch=self._current_epoch, who=self.name, timeout=timeout, counts=self.stats
        )

        def take(layout: StateLayout) -> None:
            if self._expect is not None:  # weights that do not fit are refused before they displace anyone
                self._expect(layout)
            # One sender at a time: a newer one (a promoted leader) replaces the old.
            with self._cond:
                previous, self._sender = self._sender, conn
            if previous is not None:
                previous.close()
            with self._receiving:  # the previous session has let go of the staging buffer
                self._adopt(layout)

        answer_layout(conn, layout, take, timeout)
        receive_versions(
            conn,
            [(b.lo, b.hi) for b in tensor_buckets(layout)],
            fingerprint=fingerprint_int(layout.fingerprint),
            timeout=timeout,
            who=self.name,
            counts=self.stats,
            current_epoch=self._current_epoch,
            closed=self._closed,
            sender=lambda: self._sender,
            lock=self._receiving,
            stage=self._stage,
            complete=self._complete,
        )

    def _adopt(self, layout: StateLayout) -> None:
        with self._cond:
            if self._layout is not None:
                if self._layout.fingerprint == layout.fingerprint:
                    return
                self._layout.check_matches(layout)
            self._layout = layout
            self._page = PageBuffer(layout.total_bytes) if self._buffers == 1 else None
            self._staging = (
                self._page.tensor if self._page is not None else torch.empty(layout.total_bytes, dtype=torch.uint8)
            )
            self._ready = torch.empty(layout.total_bytes, dtype=torch.uint8) if self._buffers == 2 else None
            self._ready_step = None if self._buffers == 1 else self._ready_step
            self._spare = None
        logger.info("[engine %d] receiving %d tensors, %d bytes", self.index, len(layout.entries), layout.total_bytes)

    def _stage(self, begin: Begin) -> torch.Tensor:
        """Where version ``begin.step`` is received. With one buffer: once nobody holds the
        ready version in it (an apply in progress finishes first), which is then no longer ready.
        ``on_receiving`` hears of it (a prepared version it supersedes can go)."""
        with self._cond:
            if self._buffers == 1:
                if not self._cond.wait_for(
                    lambda: self._held_buffer is not self._staging or self._closed.is_set(),
                    self.config.timeout.total_seconds(),
                ):
                    raise TransportError(f"{self.name}: the ready version was held for over {self.config.timeout}")
                if self._ready is self._staging:
                    self._ready, self._ready_step = None, None
            staging = self._staging
        assert staging is not None  # _adopt made it: a session's layout comes before its versions
        if self._on_receiving is not None:
            self._on_receiving(begin.step)
        return staging

    def _complete(self, begin: Begin, buffer: torch.Tensor, digests: list[int]) -> None:
        """The staging buffer holds version ``begin.step`` complete and verified: it
        becomes the ready version; the next one goes where nobody reads (with two buffers)."""
        with self._cond:
            previous, self._ready, self._ready_step = self._ready, buffer, begin.step
            self._epochs[begin.step] = begin.epoch
            for old in sorted(self._epochs)[:-_EPOCHS_KEPT]:
                del self._epochs[old]
            if self._buffers == 1:
                pass  # the next version waits in _stage until this one is let go
            elif previous is not self._held_buffer:
                self._staging = previous
            else:
                assert previous is not None  # two buffers: _adopt made the ready one
                if self._spare is None:
                    self._spare = torch.empty_like(previous)
                self._staging, self._spare = self._spare, previous
            self._cond.notify_all()
        if self._on_ready is not None:
            self._on_ready(begin.step)
