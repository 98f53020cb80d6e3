"""The bucket stream, both ends: one implementation of the protocol of
``replica.session.protocol`` shared by the mirror (a trainer rank -> its standby) and
weight sync (the trainers' leader -> every rollout engine).

Sender: ``open_session`` connects to a registration and sends the epoch and
the layout; per version an ``Outgoing`` sends ``BEGIN`` (step, bucket count,
epoch), the buckets under ``BUCKET_BASE + i`` with at most
``Config.num_inflight_buckets`` in flight (keeping the digest each send
took), and ``settle`` reads the replies: ACKED, RESEND (the named buckets go
again, at most ``Config.max_resends`` rounds) or FENCED. Weight sync fans one
version out to many engines with one ``Outgoing`` per link, bucket by bucket.

Receiver: ``accept_sender`` reads the epoch and the layout and refuses
(FENCED) an epoch that is not the current one; ``receive_versions`` then waits
for each ``BEGIN`` (until the listener closes or a newer sender replaces this
one), checks its bucket count and epoch, receives and verifies the buckets and
acknowledges.

``registration_backoff()`` paces the retries of a registration that could not be reached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, Protocol

import torch

from replica.config import Config
from replica.errors import (
    FencedError,
    LayoutMismatchError,
    PeerDisconnectedError,
    ResendsExhaustedError,
    TransferTimeoutError,
    TransportError,
)
from replica.jobstore import Epoch, Registration
from replica.session.backends import connect
from replica.session.protocol import (
    BEGIN,
    BUCKET_BASE,
    Begin,
    ReceiveCounts,
    Reply,
    Status,
    as_tensor,
    check_epoch,
    post_buckets,
    post_reply,
    receive_buckets,
    recv_epoch,
    recv_layout,
    refuse_fenced,
    send_epoch,
    send_layout,
    send_reply,
)
from replica.state.layout import StateLayout
from replica.timing import Backoff, Deadline
from replica.transport import BucketHeader, Connection, MemoryKind, Transfer, Transport
from replica.transport.base import After

__all__ = [
    "MirrorFaults",
    "Outgoing",
    "SendCounts",
    "accept_sender",
    "open_session",
    "receive_versions",
    "registration_backoff",
    "wait_first",
]

logger = logging.getLogger(__name__)

#: The first and the longest pause between two tries of a registration that could not be reached.
RETRY_FIRST = timedelta(milliseconds=50)
RETRY_MOST = timedelta(seconds=2)


@dataclass(kw_only=True, slots=True)
class MirrorFaults:
    """Fault injection for tests: ``corrupt_buckets = k`` flips a byte in each of
    the next k buckets after their digest is taken, as a bad link would;
    ``corrupted`` counts how many times that fired."""

    corrupt_buckets: int = 0
    corrupted: int = 0


class SendCounts(Protocol):
    bytes_sent: int
    resent_buckets: int


def registration_backoff() -> Backoff:
    """When to try a registration again after a failure: ``RETRY_FIRST`` after the
    first, doubling up to ``RETRY_MOST``."""
    return Backoff(first=RETRY_FIRST, most=RETRY_MOST)


# --- the sender ---


def _expect_reply(
    conn: Connection, step: int, timeout: timedelta, peer: str, posted: Callable[[timedelta], Reply] | None = None
) -> Reply:
    """The peer's reply for ``step`` (``posted``: its receive, posted already by ``post_reply``)."""
    reply = (posted or post_reply(conn))(timeout)
    if reply.step != step:
        raise TransportError(f"{peer} answered for step {reply.step}, expected {step}")
    return reply


def open_session(
    registration: Registration,
    *,
    memory: MemoryKind,
    config: Config,
    epoch: Epoch,
    layout: StateLayout,
    peer: str,
    mismatch: str,
) -> tuple[Transport, Connection]:
    """Connect to the listener of ``registration`` (``replica.session.backends.connect``: its fallback
    if its backend refuses this process) and send ``epoch`` and ``layout``.
    Raises LayoutMismatchError (``peer`` refused ``mismatch``), FencedError (``epoch``
    is not the current one there) or TransportError (retryable); nothing stays open then."""
    timeout = config.timeout
    transport, conn = connect(registration, memory, config, peer=peer)
    try:
        # Posted before the epoch goes out: a refusal (FENCED) the peer sends just before it
        # closes is delivered, not lost to the close (seen under load: "peer closed").
        posted = post_reply(conn)
        send_epoch(conn, epoch, timeout)
        send_layout(conn, layout, timeout)
        reply = _expect_reply(conn, -1, timeout, peer, posted)
        if reply.status == Status.LAYOUT_MISMATCH:
            raise LayoutMismatchError(f"{peer} refused {mismatch}")
        if reply.status == Status.FENCED:
            raise FencedError(f"{peer} refused {epoch}: it is not the current one")
        if reply.status != Status.ACCEPTED:
            raise TransportError(f"{peer} answered {reply.status.name} to the layout")
    except BaseException:
        transport.close()
        raise
    return transport, conn


class Outgoing:
    """One version going out on one connection: ``begin``, ``send`` bucket by bucket
    (or ``send_all``), ``flush``, then ``settle``. ``digests[i]`` is the digest the
    send of bucket i took (of the buffer's bytes, before any injected fault).
    ``digests``, when given, holds each bucket's digest by the time it is sent
    (taken by ``ops.pack_checksum`` as it was packed); the sends then hash nothing.
    ``ready``: the event a CUDA ``buffer`` is complete after (``Snapshot.ready``;
    None: complete now): the sends wait for it alone, never for this thread's
    current stream, which holds whatever the producer queued since."""

    def __init__(
        self,
        conn: Connection,
        buffer: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        *,
        step: int,
        epoch: Epoch,
        fingerprint: int,
        config: Config,
        faults: MirrorFaults,
        counts: SendCounts,
        peer: str,
        digests: Sequence[int] | None = None,
        ready: torch.cuda.Event | None = None,
    ):
        self.conn, self.buffer, self.ranges, self.step, self.epoch = conn, buffer, ranges, step, epoch
        self._after = After.NOTHING if ready is None else ready
        self.digests = [0] * len(ranges)
        self._known = digests
        self._fingerprint, self._config, self._faults, self._counts, self._peer = (
            fingerprint,
            config,
            faults,
            counts,
            peer,
        )
        self._inflight: deque[Transfer] = deque()
        self._begin: Transfer | None = None
        self._reply: Callable[[timedelta], Reply] | None = None  # the next reply's receive, posted
        self.posted_at = self.flushed_at = 0.0  # set by send_all

    def begin(self) -> None:
        """Start sending ``BEGIN``; ``flush`` waits for it (the buckets need not: the
        transport delivers in order, and the receiver posts them once it has ``BEGIN``).
        The reply's receive is posted first: a receiver that refuses the version and
        closes the connection at once must not leave its FENCED unread."""
        self._reply = post_reply(self.conn)
        self._begin = self.conn.isend(
            as_tensor(Begin(step=self.step, num_buckets=len(self.ranges), epoch=self.epoch).encode()), tag=BEGIN
        )

    def send(self, i: int) -> None:
        """Start sending bucket ``i``, first waiting for the oldest send when the window is full."""
        if len(self._inflight) >= self._config.num_inflight_buckets:
            self._finish_oldest()
        lo, hi = self.ranges[i]
        if self._faults.corrupt_buckets > 0:  # tests: a bad link
            self._faults.corrupt_buckets -= 1
            self._faults.corrupted += 1
            self.conn.faults.corrupt_next = 1
        self._inflight.append(
            self.conn.isend(
                self.buffer[lo:hi],
                tag=BUCKET_BASE + i,
                step=self.step,
                bucket=i,
                offset=lo,
                fingerprint=self._fingerprint,
                digest=None if self._known is None else self._known[i],
                after=self._after,
            )
        )
        self._counts.bytes_sent += hi - lo

    def flush(self) -> None:
        if self._begin is not None:
            self._wait(self._begin)
            self._begin = None
        while self._inflight:
            self._finish_oldest()

    def send_all(self) -> None:
        """``begin``, every bucket, ``flush``; ``posted_at`` and ``flushed_at`` say when
        (``time.perf_counter()``) the last bucket was posted and every send had finished."""
        self.begin()
        for i in range(len(self.ranges)):
            self.send(i)
        self.posted_at = time.perf_counter()
        self.flush()
        self.flushed_at = time.perf_counter()

    def _finish_oldest(self) -> None:
        header = self._wait(self._inflight.popleft())
        self.digests[header.bucket] = header.digest

    def _wait(self, transfer: Transfer) -> BucketHeader:
        try:
            return transfer.wait(self._config.timeout)
        except PeerDisconnectedError:
            # A receiver that refuses this version answers FENCED and closes the connection
            # at once, failing the sends still in flight: an answer already in wins.
            posted, self._reply = self._reply, None
            try:
                fenced = posted is not None and posted(timedelta(0)).status == Status.FENCED
            except TransportError:
                fenced = False
            if fenced:
                raise self._fenced() from None
            raise

    def _fenced(self) -> FencedError:
        return FencedError(f"{self._peer} refused step {self.step} of {self.epoch}: it is not the current epoch")

    def settle(self) -> None:
        """Read the receiver's answer to this version: return once ACKED; send the
        buckets a RESEND names again (at most ``max_resends`` rounds); FencedError
        for FENCED; TransportError for anything else."""
        max_resends = self._config.max_resends
        for attempt in range(max_resends + 1):
            self.flush()
            posted, self._reply = self._reply, None
            reply = _expect_reply(self.conn, self.step, self._config.timeout, self._peer, posted)
            if reply.status == Status.ACKED:
                return
            if reply.status == Status.FENCED:
                raise self._fenced()
            if reply.status != Status.RESEND or not reply.buckets:
                raise TransportError(f"{self._peer} answered {reply.status.name} for step {self.step}")
            if attempt == max_resends:
                raise ResendsExhaustedError(
                    f"step {self.step}: buckets {list(reply.buckets)} still failed their "
                    f"digests after {max_resends} resends",
                    step=self.step,
                    buckets=tuple(reply.buckets),
                )
            logger.warning(
                "[step %d] %s asks again for buckets %s (attempt %d)",
                self.step,
                self._peer,
                list(reply.buckets),
                attempt + 1,
            )
            self._counts.resent_buckets += len(reply.buckets)
            self._reply = post_reply(self.conn)
            for i in reply.buckets:
                self.send(i)


# --- the receiver ---

# The longest sleep of a receiver between two looks for its sender's next message: the
# latency a new version may wait before its receives are posted, against ~2,000 wake-ups a
# second of an idle standby (~1% of a core).
_FIRST_IDLE_POLL = timedelta(microseconds=50)
_MAX_IDLE_POLL = timedelta(microseconds=500)


def wait_first(
    conn: Connection,
    transfers: Sequence[Transfer],
    *,
    gone: Callable[[], str | None],
    within: timedelta | None,
    timeout: timedelta,
    idle: Callable[[], None] | None = None,
) -> Transfer:
    """The first of ``transfers`` to finish. ``gone()`` names a reason to stop waiting
    (the listener closed, a newer sender took over) or None; ``within`` bounds the wait
    (None: the next message comes when it comes); ``idle()`` runs between looks."""
    deadline = None if within is None else Deadline.after(within)
    polls = Backoff(first=_FIRST_IDLE_POLL, most=_MAX_IDLE_POLL)
    while True:
        for transfer in transfers:
            if transfer.done():
                transfer.wait(timeout)  # verifies its digest
                return transfer
        reason = gone()
        if reason is not None:
            raise PeerDisconnectedError(reason, graceful=True)
        if deadline is not None and deadline.expired:
            raise TransferTimeoutError(f"{conn.peer} sent nothing after connecting")
        if idle is not None:
            idle()
        polls.sleep()


def _fence(
    conn: Connection,
    epoch: Epoch,
    step: int,
    current: Epoch | None,
    *,
    who: str,
    timeout: timedelta,
    counts: ReceiveCounts,
) -> None:
    try:
        check_epoch(epoch, current, who=who)
    except FencedError as exc:
        counts.fenced += 1
        refuse_fenced(conn, step, exc, timeout)


def accept_sender(
    conn: Connection,
    *,
    current_epoch: Callable[[], Epoch | None],
    who: str,
    timeout: timedelta,
    counts: ReceiveCounts,
    size: torch.Tensor | None = None,
) -> tuple[Epoch, StateLayout]:
    """A new sender's epoch and layout (``size``: its LAYOUT_SIZE message, if received
    already); a sender whose epoch is not ``current_epoch()`` is refused (FENCED) and
    FencedError raised, before it can displace anyone."""
    epoch = recv_epoch(conn, timeout)
    layout = recv_layout(conn, timeout, size)
    _fence(conn, epoch, -1, current_epoch(), who=who, timeout=timeout, counts=counts)
    return epoch, layout


def receive_versions(
    conn: Connection,
    ranges: Sequence[tuple[int, int]],
    *,
    fingerprint: int,
    timeout: timedelta,
    who: str,
    counts: ReceiveCounts,
    current_epoch: Callable[[], Epoch | None],
    closed: threading.Event,
    sender: Callable[[], Connection | None],
    lock: threading.Lock,
    stage: Callable[[Begin], torch.Tensor],
    complete: Callable[[Begin, torch.Tensor, list[int]], None],
    acknowledged: Callable[[Begin], None] | None = None,
    fence_late: bool = False,
    prestage: Callable[[], torch.Tensor | None] | None = None,
) -> NoReturn:
    """Receive versions from the sender at ``conn`` until it leaves, ``closed`` is
    set or ``sender()`` is another connection. Per version: its ``BEGIN`` (bucket
    count and epoch checked; a superseded epoch is refused), then under ``lock``
    the buckets into ``stage(begin)``, verified (``receive_buckets``), then
    ``complete(begin, buffer, digests)``, the ACK, and ``acknowledged(begin)``:
    what need not hold the sender back (the mirror's store acknowledgement, which
    the sender's next commit waits for anyway) goes there. ``fence_late``: check the
    epoch while the buckets arrive, not before (its store read leaves the stream's
    path), for a receiver whose ``stage`` loses nothing it needs to a refused version.

    ``prestage()`` (``fence_late`` only): a buffer the next version may land in
    before its ``BEGIN`` is seen, or None while there is none yet; it is asked
    again between looks for ``BEGIN``. Once it gives one, every bucket's receive is
    posted at once (under ``lock``, held until the version is done), so the bytes
    flow as soon as they are sent instead of after this thread wakes to ``BEGIN``,
    and ``stage`` is not asked."""
    if prestage is not None and not fence_late:
        raise ValueError("prestage needs fence_late: a refusal must not leave receives posted")

    def gone() -> str | None:
        if closed.is_set():
            return f"{who} closed"
        return None if sender() is conn else "a newer sender took over"

    while True:
        buf = torch.zeros(Begin.size(), dtype=torch.uint8)
        begin_recv = conn.irecv(buf, tag=BEGIN)
        early: tuple[torch.Tensor, list[tuple[int, Transfer]]] | None = None
        locked = False

        def post_early() -> None:
            nonlocal early, locked
            if prestage is None or early is not None or not lock.acquire(blocking=False):
                return
            try:
                buffer = prestage()
                if buffer is not None:
                    early = buffer, post_buckets(conn, buffer, ranges, range(len(ranges)))
            finally:
                locked = early is not None
                if not locked:
                    lock.release()

        try:
            post_early()
            wait_first(conn, [begin_recv], gone=gone, within=None, timeout=timeout, idle=post_early)
            begin = Begin.decode(buf.numpy().tobytes())
            if begin.num_buckets != len(ranges):
                raise TransportError(
                    f"step {begin.step} announced {begin.num_buckets} buckets, layout has {len(ranges)}"
                )

            # The coordinator may have moved on since the connection began.
            def fence(current: Epoch | None) -> None:
                _fence(conn, begin.epoch, begin.step, current, who=who, timeout=timeout, counts=counts)

            if not fence_late:
                fence(current_epoch())
            if not locked:
                lock.acquire()
                locked = True
            buffer, first = early if early is not None else (stage(begin), None)
            if early is not None:
                counts.prestaged += 1
            # fence_late: the epoch is read while the buckets arrive, and the refusal waits
            # for them (receives left posted would write into the next sender's staging).
            read: Future[Epoch | None] = Future()

            def read_epoch() -> None:
                try:
                    read.set_result(current_epoch())
                except Exception as exc:  # noqa: BLE001 - raised once the buckets are in
                    read.set_exception(exc)

            digests = receive_buckets(
                conn,
                buffer,
                ranges,
                step=begin.step,
                fingerprint=fingerprint,
                timeout=timeout,
                who=who,
                counts=counts,
                posted=read_epoch if fence_late else None,
                first=first,
            )
            if fence_late:
                fence(read.result())
            complete(begin, buffer, digests)
            send_reply(conn, Reply(step=begin.step, status=Status.ACKED), timeout)
            if acknowledged is not None:
                acknowledged(begin)
        finally:
            if locked:
                lock.release()
