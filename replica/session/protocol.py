"""Messages between a trainer rank (``Replicator``) and its standby (``Mirror``)
over one ``replica.transport`` connection, and between the trainers' leader
(``WeightSync``) and an engine (``WeightReceiver``): the same bucket stream,
implemented once in ``replica.session.bucketstream``. Fixed binary records, no pickle.

Per connection the trainer sends ``EPOCH`` (its generation and member id),
``LAYOUT_SIZE`` (8 bytes) and ``LAYOUT`` (the layout's JSON); the standby answers
``REPLY`` (ACCEPTED, LAYOUT_MISMATCH, or FENCED for an epoch that is not the
rank's current one). Per step: ``BEGIN`` (step, bucket count, epoch), then bucket i under tag
``BUCKET_BASE + i``; the standby verifies every digest and answers ``REPLY``:
ACKED once all are good, or RESEND with the indices of bad buckets, which the
trainer sends again under the same tags.

Repair, any time on an open session: a standby whose held version of a step
changed in memory (its scrub found buckets failing their kept digests) sends
``REPAIR`` (a ``Reply`` of status REPAIR naming the step and buckets); the
trainer answers ``REPAIR_ANSWER`` (ACCEPTED, or NOT_HELD once it holds that
step no more), then sends each named bucket in order under ``REPAIR_BUCKET``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch

from replica.errors import BucketCorruptedError, FencedError, LayoutMismatchError, TransportError
from replica.jobstore import Epoch
from replica.jobstore.commit import NO_EPOCH
from replica.state.layout import StateLayout
from replica.transport import Connection, Transfer
from replica.transport.base import After

__all__ = [
    "BEGIN",
    "BUCKET_BASE",
    "Begin",
    "EPOCH",
    "FETCH",
    "FETCHED",
    "LAYOUT",
    "LAYOUT_SIZE",
    "MAX_REPORTED",
    "REPAIR",
    "REPAIR_ANSWER",
    "REPAIR_BUCKET",
    "REPLY",
    "REPLY_BYTES",
    "ReceiveCounts",
    "Reply",
    "Status",
    "answer_layout",
    "as_tensor",
    "check_epoch",
    "fingerprint_int",
    "post_buckets",
    "post_reply",
    "receive_buckets",
    "recv_epoch",
    "recv_layout",
    "recv_reply",
    "refuse_fenced",
    "send_epoch",
    "send_layout",
    "send_reply",
]

logger = logging.getLogger(__name__)

LAYOUT_SIZE = 1
LAYOUT = 2
BEGIN = 3
REPLY = 4
FETCH = 5
EPOCH = 6
# The fetcher got every bucket: the standby may close. A send that completed on the sender
# (eager over tcp) may still be on its way; closing at once raced it (the fetcher saw the
# goodbye before the last bucket, under load).
FETCHED = 7
BUCKET_BASE = 16

REPLY_BYTES = 4096
_BEGIN = struct.Struct("<qqqq")
_EPOCH = struct.Struct("<qq")
_REPLY = struct.Struct("<qiI")
_INDEX = struct.Struct("<I")
MAX_REPORTED = (REPLY_BYTES - _REPLY.size) // _INDEX.size

# The repair of a version damaged at rest: tags of their own, so a repair never
# meets a step's stream, which may run on the same connection at the same time.
REPAIR = 12
REPAIR_ANSWER = 13
REPAIR_BUCKET = 14


class Status(enum.IntEnum):
    ACCEPTED = 1
    ACKED = 2
    RESEND = 3
    LAYOUT_MISMATCH = 4
    NOT_HELD = 5
    FENCED = 6
    REPAIR = 10  # standby -> trainer: re-send these buckets of this step
    DAMAGED = 11  # the version asked for changed in memory; the buckets named fail their digests


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def fingerprint_int(fingerprint: str) -> int:
    """The layout fingerprint as the 60-bit integer bucket headers carry."""
    return int(fingerprint[:15], 16)


@dataclass(kw_only=True, frozen=True, slots=True)
class Begin:
    step: int
    num_buckets: int
    epoch: Epoch = NO_EPOCH

    def encode(self) -> bytes:
        return _BEGIN.pack(self.step, self.num_buckets, self.epoch.generation, self.epoch.member)

    @classmethod
    def decode(cls, data: bytes) -> Begin:
        step, num_buckets, generation, member = _BEGIN.unpack(data)
        return cls(step=step, num_buckets=num_buckets, epoch=Epoch(generation=generation, member=member))

    @staticmethod
    def size() -> int:
        return _BEGIN.size


@dataclass(kw_only=True, frozen=True, slots=True)
class Reply:
    step: int
    status: Status
    buckets: tuple[int, ...] = ()

    def encode(self) -> bytes:
        # A RESEND names at most MAX_REPORTED buckets; the rest come back in the next round.
        shown = self.buckets[:MAX_REPORTED]
        body = _REPLY.pack(self.step, int(self.status), len(shown)) + b"".join(_INDEX.pack(b) for b in shown)
        return body.ljust(REPLY_BYTES, b"\0")

    @classmethod
    def decode(cls, data: bytes) -> Reply:
        step, status, count = _REPLY.unpack_from(data)
        if count > MAX_REPORTED:
            raise ValueError(f"reply names {count} buckets, at most {MAX_REPORTED} fit")
        buckets = tuple(_INDEX.unpack_from(data, _REPLY.size + i * _INDEX.size)[0] for i in range(count))
        return cls(step=step, status=Status(status), buckets=buckets)

    @classmethod
    def resend(cls, step: int, buckets: Sequence[int]) -> Reply:
        return cls(step=step, status=Status.RESEND, buckets=tuple(buckets))


_MAX_LAYOUT_BYTES = 256 << 20


def send_reply(conn: Connection, reply: Reply, timeout: timedelta) -> None:
    conn.send(as_tensor(reply.encode()), tag=REPLY, timeout=timeout)


def post_reply(conn: Connection) -> Callable[[timedelta], Reply]:
    """Post the receive of the peer's next REPLY now; returns what waits for it and
    decodes it. Posted before the peer can answer, a reply sent just before the peer
    closed the connection (a FENCED refusal) is still delivered: a transfer that
    finished counts before the connection's end does."""
    buf = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    transfer = conn.irecv(buf, tag=REPLY)

    def wait(timeout: timedelta) -> Reply:
        transfer.wait(timeout)
        return Reply.decode(buf.numpy().tobytes())

    return wait


def recv_reply(conn: Connection, timeout: timedelta) -> Reply:
    return post_reply(conn)(timeout)


def send_epoch(conn: Connection, epoch: Epoch, timeout: timedelta) -> None:
    conn.send(as_tensor(_EPOCH.pack(epoch.generation, epoch.member)), tag=EPOCH, timeout=timeout)


def recv_epoch(conn: Connection, timeout: timedelta) -> Epoch:
    buf = torch.zeros(_EPOCH.size, dtype=torch.uint8)
    conn.recv(buf, tag=EPOCH, timeout=timeout)
    generation, member = _EPOCH.unpack(buf.numpy().tobytes())
    return Epoch(generation=generation, member=member)


def check_epoch(epoch: Epoch, current: Epoch | None, *, who: str) -> None:
    """Refuse a sender whose epoch is not ``current`` (None: no coordinator, any is fine)."""
    if current is not None and epoch != current:
        raise FencedError(f"{who}: refused a sender of {epoch}; the current one is {current}")


def refuse_fenced(conn: Connection, step: int, exc: FencedError, timeout: timedelta) -> None:
    """Tell a fenced sender why it is refused, then end its session with ``exc``."""
    with contextlib.suppress(TransportError):  # it may be gone already; the refusal stands either way
        send_reply(conn, Reply(step=step, status=Status.FENCED), timeout)
    raise exc


def send_layout(conn: Connection, layout: StateLayout, timeout: timedelta) -> None:
    text = layout.to_json().encode()
    conn.send(as_tensor(len(text).to_bytes(8, "little")), tag=LAYOUT_SIZE, timeout=timeout)
    conn.send(as_tensor(text), tag=LAYOUT, timeout=timeout)


def recv_layout(conn: Connection, timeout: timedelta, size: torch.Tensor | None = None) -> StateLayout:
    """The peer's layout; ``size`` is the LAYOUT_SIZE message if it was received already."""
    if size is None:
        size = torch.zeros(8, dtype=torch.uint8)
        conn.recv(size, tag=LAYOUT_SIZE, timeout=timeout)
    n = int.from_bytes(size.numpy().tobytes(), "little")
    if not 0 < n <= _MAX_LAYOUT_BYTES:
        raise ValueError(f"a layout of {n} bytes was announced")
    text = torch.empty(n, dtype=torch.uint8)
    conn.recv(text, tag=LAYOUT, timeout=timeout)
    return StateLayout.from_json(text.numpy().tobytes().decode())


class ReceiveCounts(Protocol):
    bytes_received: int
    corrupted_buckets: int
    fenced: int  # senders refused for their epoch (at connect or at a BEGIN)
    prestaged: int  # versions whose receives were posted before their BEGIN


def post_buckets(
    conn: Connection, buffer: torch.Tensor, ranges: Sequence[tuple[int, int]], indices: Sequence[int]
) -> list[tuple[int, Transfer]]:
    """Post the receive of bucket i into ``buffer[lo:hi]`` for each i of ``indices``.
    ``buffer`` is the receiving session's alone, with no work queued on it (a version
    made by ``transfer_buffer``, written only by receives): the bytes land at once,
    never after a thread's current stream (an engine's inference)."""
    return [
        (i, conn.irecv(buffer[ranges[i][0] : ranges[i][1]], tag=BUCKET_BASE + i, after=After.NOTHING)) for i in indices
    ]


def receive_buckets(
    conn: Connection,
    buffer: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    *,
    step: int,
    fingerprint: int,
    timeout: timedelta,
    who: str,
    counts: ReceiveCounts,
    posted: Callable[[], None] | None = None,
    first: list[tuple[int, Transfer]] | None = None,
) -> list[int]:
    """Receive bucket i of ``step`` into ``buffer[lo:hi]`` for every ``(lo, hi)`` of
    ``ranges``, checking each digest and header; buckets that fail their digest
    are asked for again (RESEND) until all are good. ``counts`` is updated as it
    goes (a session cut short still counts what it saw). Used by the standby and
    the engine receiver alike. Returns the digest each good bucket's header
    carried (0s when the connection does not verify), to keep with the version.
    ``posted()`` runs once the first receives are posted, while the bytes arrive.
    ``first``: every bucket's receive, posted already (``post_buckets``)."""
    todo, unreported = list(range(len(ranges))), []
    digests = [0] * len(ranges)
    while todo:
        transfers, first = first or post_buckets(conn, buffer, ranges, todo), None
        if posted is not None:
            posted()
            posted = None
        bad = []
        for i, transfer in transfers:
            try:
                header = transfer.wait(timeout)
            except BucketCorruptedError as exc:
                logger.warning("[%s step %d] %s", who, step, exc)
                counts.corrupted_buckets += 1
                bad.append(i)
                continue
            if (header.step, header.bucket, header.offset, header.fingerprint) != (step, i, ranges[i][0], fingerprint):
                raise TransportError(f"bucket {i} of step {step} arrived with header {header}")
            counts.bytes_received += header.nbytes
            digests[i] = header.digest
        bad += unreported
        todo, unreported = bad[:MAX_REPORTED], bad[MAX_REPORTED:]
        if todo:
            send_reply(conn, Reply.resend(step, todo), timeout)
    return digests


def answer_layout(
    conn: Connection, layout: StateLayout, adopt: Callable[[StateLayout], None], timeout: timedelta
) -> None:
    """Answer a sender's layout: ACCEPTED once ``adopt`` took it, LAYOUT_MISMATCH
    (and the mismatch re-raised) when it refused."""
    try:
        adopt(layout)
    except LayoutMismatchError:
        send_reply(conn, Reply(step=-1, status=Status.LAYOUT_MISMATCH), timeout)
        raise
    send_reply(conn, Reply(step=-1, status=Status.ACCEPTED), timeout)
