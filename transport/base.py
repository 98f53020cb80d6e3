"""The Transport abstraction: connect to a peer, move tensors under tags.

Public methods here own the guards, digests, timing and NVTX ranges (template
method); a backend implements only ``_listen/_accept/_connect`` on the
transport and ``_isend/_irecv/_abort`` on the connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar, Protocol, TypedDict

import torch

from replica import ops
from replica.errors import (
    BucketCorruptedError,
    PeerDisconnectedError,
    TransferTimeoutError,
    TransportError,
)
from replica.timing import Backoff, Deadline, pause
from replica.transport.wire import HEADER_BYTES, BucketHeader

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = [
    "AUTO_VERIFY_THREADS_MAX",
    "After",
    "Capabilities",
    "Connection",
    "Locality",
    "MAX_OFFSET",
    "MAX_TAG",
    "MemoryKind",
    "PIECE_BYTES",
    "Pending",
    "SendFaults",
    "Transfer",
    "Transport",
    "bucket_digest",
    "check_verify_threads",
    "nvtx_range",
    "ready_event",
    "resolve_verify_threads",
    "select_transport",
    "valid_offset",
]

logger = logging.getLogger(__name__)

#: Tags are 40-bit: backends keep the upper bits for connection ids and kinds.
MAX_TAG = (1 << 40) - 1


class MemoryKind(enum.Flag):
    HOST = enum.auto()
    CUDA = enum.auto()


class Locality(enum.Flag):
    SAME_NODE = enum.auto()
    REMOTE = enum.auto()


@dataclass(kw_only=True, frozen=True, slots=True)
class Capabilities:
    """What a backend can move and between which peers; callers choose backends by this."""

    memory: MemoryKind
    locality: Locality

    def supports(self, memory: MemoryKind, locality: Locality) -> bool:
        return memory in self.memory and locality in self.locality


try:
    import nvtx as _nvtx

    def nvtx_range(name: str) -> contextlib.AbstractContextManager[object]:
        return _nvtx.annotate(name, domain="replica")

except ImportError:  # the ranges are for profiles only; nothing depends on them

    def nvtx_range(name: str) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


class After(enum.Enum):
    """What a send waits for before it reads a CUDA buffer, or a receive before it
    writes one, when the caller gives no ``torch.cuda.Event`` of its own."""

    #: The work queued on the buffer's device's current stream when the call is made,
    #: in the calling thread (torch's convention for collectives). Right only in the
    #: thread that queued the buffer's producers: from a background thread it orders
    #: the transfer after whatever the producer queued since (the next training step).
    CURRENT_STREAM = enum.auto()
    #: Nothing: the buffer is complete (a send) or free (a receive) already; the caller
    #: synchronized its producers or owns the buffer alone.
    NOTHING = enum.auto()


def ready_event(flat: torch.Tensor, after: After | torch.cuda.Event) -> torch.cuda.Event | None:
    """The event a transfer of ``flat`` waits for before it touches its bytes (None:
    nothing to wait for). Called in the caller's thread, at the call: ``CURRENT_STREAM``
    is that thread's current stream, now."""
    if flat.device.type != "cuda" or flat.numel() == 0 or after is After.NOTHING:
        return None
    if after is After.CURRENT_STREAM:
        event = torch.cuda.Event(blocking=True)  # host waits on it sleep, never spin
        event.record(torch.cuda.current_stream(flat.device))
        return event
    if not isinstance(after, torch.cuda.Event):
        raise TypeError(f"after must be an After or a torch.cuda.Event, got {type(after).__name__}")
    return after


_side_streams: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


@contextlib.contextmanager
def _ordered_after(flat: torch.Tensor, ready: torch.cuda.Event | None):
    """Run the block's CUDA work on ``flat`` on a side stream ordered after ``ready``
    alone: never on the calling thread's current stream, where a background thread
    would wait for whatever the producer queued since."""
    if flat.device.type != "cuda":
        yield
        return
    with _side_lock:
        stream = _side_streams.get(flat.device.index)
        if stream is None:
            stream = _side_streams[flat.device.index] = torch.cuda.Stream(flat.device)
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield


def memory_kind(of: torch.Tensor | torch.device) -> MemoryKind:
    """The memory a tensor, or a device's tensors, live in."""
    device = of if isinstance(of, torch.device) else of.device
    if device.type == "cpu":
        return MemoryKind.HOST
    if device.type == "cuda":
        return MemoryKind.CUDA
    raise TransportError(f"cannot transfer tensors on {device}")


def as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor, never a copy."""
    if not t.is_contiguous():
        raise TransportError(f"{what} must be contiguous (strides {t.stride()})")
    return t.detach().reshape(-1).view(torch.uint8)


#: A bucket's offset (its header's ``offset``) keys its digest: a multiple of 8, below this.
MAX_OFFSET = 1 << 62


def valid_offset(offset: int) -> bool:
    """Whether ``offset`` can key a bucket's digest: a multiple of 8 in [0, MAX_OFFSET)."""
    return 0 <= offset < MAX_OFFSET and offset % 8 == 0


def _check_offset(offset: int) -> None:
    if not valid_offset(offset):
        raise ValueError(f"a bucket's offset must be a multiple of 8 in [0, 2^62), got {offset}")


def bucket_digest(flat: torch.Tensor, *, offset: int = 0, threads: int | None = None) -> int:
    """One 64-bit digest over a whole bucket (0 for an empty one): its words keyed from
    ``offset`` (the bucket's place in the buffer it belongs to, a multiple of 8), so it
    equals that block's digest in ``ops.checksum(buffer, bucket_bytes)`` and a sender
    that packed the buffer with ``ops.pack_checksum`` has it already. ``threads``: as
    in ``ops.checksum``."""
    n = flat.numel()
    if n == 0:
        return 0
    return int(ops.checksum(flat, -(-n // 8) * 8, offset // 8, threads=threads)[0].item())


#: The most threads ``verify_threads=0`` picks (idle OpenMP threads spin a while before
#: they sleep). Eight were not enough for a GPU's copy engines: on an H200 machine (16
#: cores) a standby hashed the 64 MiB buckets pushed into its pinned host memory at ~30
#: GB/s on eight, where one device-to-host copy runs at 55 GB/s (docs/benchmarks.md).
AUTO_VERIFY_THREADS_MAX = 16


def check_verify_threads(value: object) -> None:
    """ValueError unless ``value`` can be a ``verify_threads`` setting (an int >= 0; 0: automatic)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"verify_threads must be an int >= 0 (0: automatic), got {value!r}")


def resolve_verify_threads(requested: int) -> int:
    """The threads a receiver verifies with for ``EndpointConfig.verify_threads``: as
    asked, or for 0 every core this process may run on but two, at least one and at most
    ``AUTO_VERIFY_THREADS_MAX``. Hashing beside a transport that has no core of its own
    costs far more than it saves (two threads on two cores: a 512 MiB bucket over UCX
    shared memory took 227 ms instead of 60)."""
    if requested > 0:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(AUTO_VERIFY_THREADS_MAX, cores - 2))


@dataclass(kw_only=True, slots=True)
class SendFaults:
    """Fault injection on a connection's sends, for tests: ``corrupt_next = k`` flips
    one byte of the next k buckets *after* their digest is taken (as a bad link
    would); ``corrupted`` counts how many times that fired."""

    corrupt_next: int = 0
    corrupted: int = 0


class Pending(Protocol):
    """A backend's in-flight operation. A backend whose operations are finished by
    a thread of its own also gives each a ``completion`` (``threading.Event``) that
    it sets when the operation finished or its connection failed; waiters then
    sleep on it instead of polling."""

    def poll(self) -> bool:
        """True once finished; raises the backend's error if it failed."""
        ...


# How long a failed backend operation waits for the control channel to report
# the peer's death, so the caller sees PeerDisconnectedError, not a backend error.
_EXPLAIN = timedelta(milliseconds=500)
# Polled backends (UCX): the first sleeps are short, since small transfers finish
# within microseconds, and the longest is short too, since a sleep that outlasts
# the transfer is pure latency. Python's sleep has ~50 us of timer slack anyway.
_FIRST_POLL_SLEEP = timedelta(microseconds=10)
_MAX_POLL_SLEEP = timedelta(microseconds=100)
# Backends with a completion event wake the waiter themselves, also on failure;
# the slice only bounds how late a failure the backend did not signal is seen.
_COMPLETION_SLICE = timedelta(milliseconds=50)


def _seconds(timeout: timedelta) -> float:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    return timeout.total_seconds()


#: Buckets above this many bytes travel as pieces of it (a multiple of 8), each a
#: message of its own under the bucket's tag (every backend delivers one tag's
#: messages in order): the receiver hashes piece k while piece k + 1 arrives, so
#: only the last piece's hash follows the transfer. Both sides split alike (the
#: backend's ``piece_bytes``; this is the default).
PIECE_BYTES = 16 << 20


def _pieces(n: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    if piece_bytes is None or n <= piece_bytes:
        return [(0, n)]
    return [(lo, min(lo + piece_bytes, n)) for lo in range(0, n, piece_bytes)]


@dataclass(slots=True)
class _Piece:
    pending: Pending
    flat: torch.Tensor
    header_buf: torch.Tensor | None  # receives only
    done: bool = False


class Transfer:
    """Handle of one send or receive in flight; ``wait`` finishes it."""

    def __init__(
        self,
        conn: Connection,
        pieces: list[_Piece],
        *,
        kind: str,
        tag: int,
        buf: torch.Tensor,
        header: BucketHeader | None,
    ):
        self._conn = conn
        self._pieces = pieces
        self._kind = kind
        self._tag = tag
        self._buf = buf  # kept alive until the backend is done with it
        self._header = header
        self._done = False

    def done(self) -> bool:
        """Non-blocking: True when ``wait`` would return without waiting."""
        return self._done or all(piece.done or self._poll(piece) for piece in self._pieces)

    def wait(self, timeout: timedelta) -> BucketHeader:
        """Block until finished; returns the bucket's header (verified, for receives).

        Raises PeerDisconnectedError if the peer died or closed the connection,
        TransferTimeoutError past ``timeout`` (the connection is then closed: its
        buffers may still be written by a late message), BucketCorruptedError if
        a received bucket fails its digest (once all of its pieces are in).
        """
        if self._done:
            if self._header is None:  # a receive whose checks raised
                raise TransportError(f"{self._kind} of tag {self._tag} failed its checks: it has no header")
            return self._header
        deadline = Deadline.after(timeout)
        headers, sums = [], []
        with nvtx_range(f"replica::{self._kind}"):
            for piece in self._pieces:
                self._wait_piece(piece, deadline, timeout)
                if self._kind == "recv":  # verified while the next pieces arrive
                    assert piece.header_buf is not None, "a receive's pieces each have a header buffer"
                    header, term_sum = self._conn._check_piece(
                        self._tag, piece.flat, piece.header_buf, getattr(piece.pending, "digest", None)
                    )
                    headers.append(header)
                    sums.append(term_sum)
        self._done = True
        if self._kind == "recv":
            self._header = self._conn._verify(self._tag, self._buf, headers, sums)
        assert self._header is not None, "a send's header is given at its start"
        return self._header

    def _wait_piece(self, piece: _Piece, deadline: Deadline, timeout: timedelta) -> None:
        completion: threading.Event | None = getattr(piece.pending, "completion", None)
        polls: Backoff | None = None  # made at the first sleep: most pieces are done at once
        while not (piece.done or self._poll(piece)):
            if deadline.expired:
                self._conn._fail(
                    TransferTimeoutError(
                        f"{self._kind} of tag {self._tag} to {self._conn.peer} did not finish "
                        f"within {_seconds(timeout):.3f} s; connection closed"
                    )
                )
                raise self._conn._failure()
            if completion is not None:
                pause(_COMPLETION_SLICE, completion, deadline)
            else:
                polls = polls or Backoff(first=_FIRST_POLL_SLEEP, most=_MAX_POLL_SLEEP)
                polls.sleep(deadline=deadline)

    def _poll(self, piece: _Piece) -> bool:
        # The transfer's own state first: a bucket that arrived completely
        # before its peer went away is delivered, not lost.
        try:
            if piece.pending.poll():
                piece.done = True
                return True
        except TransportError:
            raise
        except Exception as exc:  # a backend error, often the first sign of the peer's death
            # The control channel says whether the peer is gone; give it a moment.
            if not self._conn._failed.wait(_EXPLAIN.total_seconds()):
                self._conn._fail(TransportError(f"{self._kind} of tag {self._tag} failed: {exc}"))
            raise self._conn._failure() from exc
        if self._conn._error is not None:
            raise self._conn._error
        return False


class _SendOptions(TypedDict, total=False):  # what Connection.send passes on to isend
    step: int
    bucket: int
    offset: int
    fingerprint: int
    digest: int | None
    after: After | torch.cuda.Event


class Connection(ABC):
    """One authenticated peer. Thread-safe for concurrent transfers."""

    #: Pieces a bucket goes in (see PIECE_BYTES); None: one message per bucket.
    piece_bytes: int | None = PIECE_BYTES

    def __init__(self, *, peer: str, memory: MemoryKind, verify: bool, verify_threads: int = 1):
        self.peer = peer
        self._memory = memory
        self._verify_digests = verify
        self._verify_threads = resolve_verify_threads(verify_threads)
        self._error: TransportError | None = None
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self.faults = SendFaults()

    @property
    def alive(self) -> bool:
        return self._error is None

    def isend(
        self,
        buf: torch.Tensor,
        *,
        tag: int,
        step: int = 0,
        bucket: int = 0,
        offset: int = 0,
        fingerprint: int = 0,
        digest: int | None = None,
        after: After | torch.cuda.Event = After.CURRENT_STREAM,
    ) -> Transfer:
        """Start sending ``buf`` (contiguous, host or CUDA) under ``tag``; returns at once.

        ``digest``: ``bucket_digest(buf, offset=offset)``, when the caller has it already
        (``ops.pack_checksum`` took it while packing); otherwise it is computed here
        while the payload is on its way (when the connection verifies digests).
        A bucket above ``piece_bytes`` goes as pieces; the last one's header carries
        the digest of the whole. ``after``: what a CUDA ``buf`` is complete after (an
        event recorded behind its producers, or ``After``); the send reads it after
        that and nothing else."""
        flat = self._guard(buf, tag, "buf")
        _check_offset(offset)
        self._check_bucket(flat)
        ready = ready_event(flat, after)
        payload = flat
        if self.faults.corrupt_next > 0 and flat.numel() > 0:
            self.faults.corrupt_next -= 1
            self.faults.corrupted += 1
            with _ordered_after(flat, ready):
                payload = flat.clone()
                payload[flat.numel() // 2] ^= 0xFF
                if flat.is_cuda:  # the clone is complete once its side stream is
                    ready = torch.cuda.Event(blocking=True)
                    ready.record()
        whole = BucketHeader(
            step=step, bucket=bucket, offset=offset, nbytes=flat.numel(), digest=0, fingerprint=fingerprint
        )
        spans = _pieces(flat.numel(), self.piece_bytes)

        def header_of(lo: int, hi: int) -> Callable[[], bytes]:
            def finish_header() -> bytes:
                # Called by the backend once the piece is on its way, so hashing
                # overlaps the transfer; the digest is of the caller's bytes.
                nonlocal whole
                value = 0
                if self._verify_digests and hi == flat.numel():
                    if digest is not None:
                        value = digest
                    else:
                        with nvtx_range("replica::digest"), _ordered_after(flat, ready):
                            value = bucket_digest(flat, offset=offset)
                    whole = dataclasses.replace(whole, digest=value)
                return dataclasses.replace(whole, offset=offset + lo, nbytes=hi - lo, digest=value).encode()

            return finish_header

        pieces = []
        with nvtx_range("replica::post_send"):
            for lo, hi in spans:
                part = payload[lo:hi] if len(spans) > 1 else payload
                pieces.append(_Piece(self._isend(part, tag, header_of(lo, hi), ready), part, None))
        # The backends take the last header while posting its piece: `whole` has its digest now.
        return Transfer(self, pieces, kind="send", tag=tag, buf=payload, header=whole)

    def irecv(self, buf: torch.Tensor, *, tag: int, after: After | torch.cuda.Event = After.CURRENT_STREAM) -> Transfer:
        """Start receiving the next bucket sent under ``tag`` directly into ``buf``.
        ``after``: what a CUDA ``buf`` is free after (work queued on it before); the
        received bytes land after that and wait for nothing else."""
        flat = self._guard(buf, tag, "buf")
        ready = ready_event(flat, after)
        spans = _pieces(flat.numel(), self.piece_bytes)
        pieces = []
        with nvtx_range("replica::post_recv"):
            for lo, hi in spans:
                part = flat[lo:hi] if len(spans) > 1 else flat
                header_buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
                pieces.append(_Piece(self._irecv(part, tag, header_buf, ready), part, header_buf))
        return Transfer(self, pieces, kind="recv", tag=tag, buf=flat, header=None)

    def send(self, buf: torch.Tensor, *, tag: int, timeout: timedelta, **meta: Unpack[_SendOptions]) -> BucketHeader:
        return self.isend(buf, tag=tag, **meta).wait(timeout)

    def recv(self, buf: torch.Tensor, *, tag: int, timeout: timedelta) -> BucketHeader:
        return self.irecv(buf, tag=tag).wait(timeout)

    def close(self) -> None:
        """Close the connection; transfers still in flight fail with PeerDisconnectedError."""
        self._fail(
            PeerDisconnectedError(f"connection to {self.peer} was closed by this side", graceful=True), quiet=True
        )

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- for backends ---

    def _fail(self, error: TransportError, *, quiet: bool = False) -> None:
        """Mark the connection dead with ``error`` (first error wins) and release it."""
        with self._lock:
            if self._error is None:
                self._error = error
                self._failed.set()
            if self._closed:
                return
            self._closed = True
        if not quiet:  # a peer that said goodbye ended it, nothing failed
            graceful = isinstance(error, PeerDisconnectedError) and error.graceful
            logger.log(
                logging.INFO if graceful else logging.WARNING,
                "connection to %s %s: %s",
                self.peer,
                "ended" if graceful else "failed",
                error,
            )
        self._abort()

    def _failure(self) -> TransportError:
        """The error the connection failed with: called only once it has (``_fail`` set it)."""
        assert self._error is not None, "the connection has not failed"
        return self._error

    def _guard(self, buf: torch.Tensor, tag: int, what: str) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag must be in [0, {MAX_TAG}], got {tag}")
        kind = memory_kind(buf)
        if kind not in self._memory:
            raise TransportError(f"this transport cannot move {kind.name} memory ({buf.device})")
        return as_bytes(buf, what)

    def _check_piece(
        self, tag: int, flat: torch.Tensor, header_buf: torch.Tensor, taken: int | None = None
    ) -> tuple[BucketHeader, int]:
        """A received piece's header, and its digest (0 when not verifying), taken at
        once: the next pieces are still arriving. ``taken``: the digest the backend
        took while it copied the piece in (keyed by the header's offset), if it did."""
        with nvtx_range("replica::verify"):
            try:
                header = BucketHeader.decode(header_buf.numpy().tobytes())
            except ValueError as exc:
                raise TransportError(f"bad header for tag {tag} from {self.peer}: {exc}") from exc
            if header.nbytes != flat.numel():
                raise TransportError(
                    f"tag {tag} from {self.peer}: sender sent {header.nbytes} bytes into a "
                    f"{flat.numel()}-byte receive buffer"
                )
            if not self._verify_digests:
                return header, 0
            if not valid_offset(header.offset):
                raise TransportError(f"tag {tag} from {self.peer}: a bucket offset of {header.offset} bytes")
            if taken is not None:
                return header, taken
            return header, bucket_digest(flat, offset=header.offset, threads=self._verify_threads)

    def _verify(self, tag: int, flat: torch.Tensor, headers: list[BucketHeader], digests: list[int]) -> BucketHeader:
        """The bucket's header, from its pieces' (each checked by ``_check_piece``);
        BucketCorruptedError if their bytes do not make the digest the last one carries."""
        first, last = headers[0], headers[-1]
        header = dataclasses.replace(last, offset=first.offset, nbytes=flat.numel())
        at = first.offset
        for piece in headers:
            if (piece.step, piece.bucket, piece.fingerprint, piece.offset) != (
                first.step,
                first.bucket,
                first.fingerprint,
                at,
            ):
                raise TransportError(f"tag {tag} from {self.peer}: piece {piece} does not follow {first}")
            at += piece.nbytes
        if self._verify_digests:
            got = digests[0] if len(digests) == 1 else ops.combine_digests(digests, [h.nbytes for h in headers])
            if got != header.digest:
                raise BucketCorruptedError(
                    f"bucket {header.bucket} of step {header.step} (tag {tag}) from {self.peer} "
                    "failed its digest; ask for it again",
                    step=header.step,
                    bucket=header.bucket,
                    tag=tag,
                )
        return header

    def _check_bucket(self, flat: torch.Tensor) -> None:  # noqa: B027 - a hook: most backends send any bucket
        """Refuse a bucket this backend cannot send (before any of its pieces goes)."""

    @abstractmethod
    def _isend(
        self, flat: torch.Tensor, tag: int, header: Callable[[], bytes], ready: torch.cuda.Event | None
    ) -> Pending:
        """Post ``flat`` then the header that ``header()`` returns, under ``tag``;
        a CUDA ``flat`` is read only once ``ready`` (if any) completed."""

    @abstractmethod
    def _irecv(self, flat: torch.Tensor, tag: int, header_buf: torch.Tensor, ready: torch.cuda.Event | None) -> Pending:
        """Post the receive of the next message under ``tag`` into ``flat``, written
        only once ``ready`` (if any) completed."""

    @abstractmethod
    def _abort(self) -> None:
        """Release the connection's resources; pending operations must stop."""


def select_transport(
    candidates: Sequence[Transport | type[Transport]], memory: MemoryKind, locality: Locality
) -> Transport | type[Transport]:
    """The first of ``candidates`` (in order of preference) that moves ``memory`` to a
    peer at ``locality``. Candidates may be classes, to choose before constructing one."""
    for transport in candidates:
        if transport.capabilities.supports(memory, locality):
            return transport
    names = ", ".join(getattr(t, "__name__", type(t).__name__) for t in candidates) or "none"
    raise TransportError(f"no transport moves {memory.name} memory to a {locality.name} peer (have: {names})")


class Transport(ABC):
    """A process's endpoint for one backend: listens, accepts and connects."""

    capabilities: ClassVar[Capabilities]

    def listen(self) -> str:
        """Start listening; returns the address peers pass to ``connect``."""
        return self._listen()

    def accept(self, timeout: timedelta) -> Connection:
        """Wait for one peer to connect and prove the job token."""
        with nvtx_range("replica::accept"):
            return self._accept(_seconds(timeout))

    def connect(self, address: str, timeout: timedelta) -> Connection:
        """Connect to the peer listening at ``address``."""
        with nvtx_range("replica::connect"):
            return self._connect(address, _seconds(timeout))

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abstractmethod
    def _listen(self) -> str: ...

    @abstractmethod
    def _accept(self, timeout_s: float) -> Connection: ...

    @abstractmethod
    def _connect(self, address: str, timeout_s: float) -> Connection: ...
