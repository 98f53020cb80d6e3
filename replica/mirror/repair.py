"""Repair of a version damaged at rest, both ends (protocol: ``replica.session.protocol``).

A standby keeps the digest of every bucket of each version it holds; its scrub
re-checks the committed version now and then. A bucket whose bytes changed in
memory (a bit flip while the standby waited) makes the version refused by
restore, export and fetch. ``request_repair`` then asks the trainer, on the
session's own connection, for those buckets again; the trainer's stream answers
from its snapshot of that step (``serve_repairs``, a thread of its own) if it
still holds it: a trainer keeps the snapshot of the last commit until the next
commit. A bucket is written back only when it matches the digest the standby
kept, so a trainer that overwrote its snapshot meanwhile cannot damage it more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from replica.errors import BucketCorruptedError, TransportError
from replica.session.protocol import (
    MAX_REPORTED,
    REPAIR,
    REPAIR_ANSWER,
    REPAIR_BUCKET,
    REPLY_BYTES,
    Reply,
    Status,
    as_tensor,
    fingerprint_int,
)
from replica.state.snapshot import Snapshot
from replica.timing import pause
from replica.transport import Connection
from replica.transport.base import After, bucket_digest

__all__ = ["request_repair", "serve_repairs"]

logger = logging.getLogger(__name__)

# How often an idle trainer looks for a repair request: a repair is rare and never urgent
# (the version stays refused until it is done), so a slow poll costs nothing.
_POLL = timedelta(milliseconds=100)


def request_repair(
    conn: Connection,
    snapshot: Snapshot,
    step: int,
    buckets: Sequence[int],
    *,
    guard: threading.Condition,
    timeout: timedelta,
    who: str,
) -> list[int]:
    """Ask the trainer at ``conn`` to send ``buckets`` of ``step`` again and write each
    into ``snapshot`` once it matches the digest kept for it. ``guard`` is held
    while a bucket is written, and the write is skipped once ``snapshot`` holds
    another step (it was staged again: a newer commit took its place). Returns
    the buckets repaired; raises TransportError if the trainer does not answer
    (its connection is then closed, as for any transfer past its deadline)."""
    if snapshot.digests is None:
        return []
    asked = tuple(buckets[:MAX_REPORTED])  # the rest wait for the next scrub
    answer = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    pending = conn.irecv(answer, tag=REPAIR_ANSWER)  # posted first: the answer may come at once
    conn.send(as_tensor(Reply(step=step, status=Status.REPAIR, buckets=asked).encode()), tag=REPAIR, timeout=timeout)
    pending.wait(timeout)
    reply = Reply.decode(answer.numpy().tobytes())
    if reply.status != Status.ACCEPTED or reply.step != step:
        logger.error(
            "[%s step %d] the trainer cannot re-send buckets %s (it answered %s for step %d)",
            who,
            step,
            list(asked),
            reply.status.name,
            reply.step,
        )
        return []
    ranges = snapshot.layout.buckets()
    fingerprint = fingerprint_int(snapshot.layout.fingerprint)
    repaired = []
    for i in asked:
        lo, hi = ranges[i]
        # Into scratch, not the version: the bucket is written only once it is known good.
        scratch = torch.empty(hi - lo, dtype=torch.uint8, device=snapshot.buffer.device)
        try:
            header = conn.recv(scratch, tag=REPAIR_BUCKET, timeout=timeout)
        except BucketCorruptedError as exc:
            logger.warning("[%s step %d] repair of bucket %d: %s", who, step, i, exc)
            continue
        if (header.step, header.bucket, header.offset, header.fingerprint) != (step, i, lo, fingerprint):
            raise TransportError(f"repair of bucket {i} of step {step} arrived with header {header}")
        if bucket_digest(scratch, offset=lo) != snapshot.digests[i]:
            logger.error(
                "[%s step %d] the trainer's bucket %d does not match the digest kept for it (its "
                "snapshot changed since): not used",
                who,
                step,
                i,
            )
            continue
        with guard:
            if snapshot.step != step:
                return repaired
            snapshot.buffer[lo:hi].copy_(scratch)
            if scratch.is_cuda:  # complete before the guard goes: later receives into it wait for nothing
                # (this thread's own stream: the copy above was queued on it, here)
                torch.cuda.current_stream(scratch.device).synchronize()
        repaired.append(i)
    return repaired


def serve_repairs(
    connection: Callable[[], Connection | None],
    snapshots: Callable[[], Sequence[Snapshot]],
    *,
    stop: threading.Event,
    timeout: timedelta,
    who: str,
    repaired: Callable[[int], None] = lambda n: None,
) -> None:
    """The trainer's end, run on a thread of its own until ``stop``: waits for a
    REPAIR on the current standby connection (``connection()``, which may change
    or vanish) and answers it from the snapshot of that step among
    ``snapshots()``; ``repaired(n)`` counts the buckets sent again."""
    while not stop.is_set():
        conn = connection()
        if conn is None or not conn.alive:
            pause(_POLL, stop)
            continue
        request = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
        try:
            pending = conn.irecv(request, tag=REPAIR)
            while not pending.done():
                # A dropped connection fails its receive; a replaced one is closed by the stream.
                if pause(_POLL, stop) or connection() is not conn:
                    break
            else:
                pending.wait(timeout)
                repaired(_answer(conn, Reply.decode(request.numpy().tobytes()), snapshots(), timeout, who))
        except TransportError as exc:  # the session ended; the next connection gets a receive of its own
            logger.debug("[%s] repair receive ended: %s", who, exc)
            pause(_POLL, stop)
        except Exception:
            logger.exception("[%s] answering a repair request failed", who)
            pause(_POLL, stop)


def _answer(conn: Connection, request: Reply, snapshots: Sequence[Snapshot], timeout: timedelta, who: str) -> int:
    step = request.step
    held = next((s for s in snapshots if s.step == step), None)
    if request.status != Status.REPAIR or held is None or any(i >= len(held.layout.buckets()) for i in request.buckets):
        logger.error(
            "[%s] the standby asks again for buckets %s of step %d, which this trainer no longer holds",
            who,
            list(request.buckets),
            step,
        )
        conn.send(as_tensor(Reply(step=step, status=Status.NOT_HELD).encode()), tag=REPAIR_ANSWER, timeout=timeout)
        return 0
    conn.send(
        as_tensor(Reply(step=step, status=Status.ACCEPTED, buckets=request.buckets).encode()),
        tag=REPAIR_ANSWER,
        timeout=timeout,
    )
    ranges = held.layout.buckets()
    fingerprint = fingerprint_int(held.layout.fingerprint)
    for i in request.buckets:
        lo, hi = ranges[i]
        # The standby writes it back only if it matches its own kept digest: a snapshot
        # packed again meanwhile (the next commit) is refused there, never trusted here.
        # After the snapshot's own event, not this thread's current stream (the next step).
        # (isend(...).wait() is what send() does; send's ``**meta: int`` has no room for ``after``)
        conn.isend(
            held.buffer[lo:hi],
            tag=REPAIR_BUCKET,
            step=step,
            bucket=i,
            offset=lo,
            fingerprint=fingerprint,
            after=After.NOTHING if held.ready is None else held.ready,
        ).wait(timeout)
    logger.warning(
        "[%s step %d] sent buckets %s again: the standby found them changed in its memory",
        who,
        step,
        list(request.buckets),
    )
    return len(request.buckets)
