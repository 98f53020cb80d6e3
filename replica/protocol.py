"""Messages between a trainer rank (``Replicator``) and its standby (``Mirror``)
over one ``replica.transport`` connection. Fixed binary records, no pickle.

Per connection the trainer sends ``LAYOUT_SIZE`` (8 bytes) and ``LAYOUT`` (the
layout's JSON); the standby answers ``REPLY`` (ACCEPTED or LAYOUT_MISMATCH).
Per step: ``BEGIN`` (step, bucket count), then bucket i under tag
``BUCKET_BASE + i``; the standby verifies every digest and answers ``REPLY``:
ACKED once all are good, or RESEND with the indices of bad buckets, which the
trainer sends again under the same tags.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from replica.layout import StateLayout
from replica.transport import Connection

__all__ = [
    "BEGIN",
    "BUCKET_BASE",
    "Begin",
    "FETCH",
    "LAYOUT",
    "LAYOUT_SIZE",
    "MAX_REPORTED",
    "REPLY",
    "REPLY_BYTES",
    "Reply",
    "Status",
    "as_tensor",
    "fingerprint_int",
    "recv_layout",
    "recv_reply",
    "send_layout",
    "send_reply",
]

LAYOUT_SIZE = 1
LAYOUT = 2
BEGIN = 3
REPLY = 4
FETCH = 5
BUCKET_BASE = 16

REPLY_BYTES = 4096
_BEGIN = struct.Struct("<qq")
_REPLY = struct.Struct("<qiI")
_INDEX = struct.Struct("<I")
MAX_REPORTED = (REPLY_BYTES - _REPLY.size) // _INDEX.size


class Status(enum.IntEnum):
    ACCEPTED = 1
    ACKED = 2
    RESEND = 3
    LAYOUT_MISMATCH = 4
    NOT_HELD = 5


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def fingerprint_int(fingerprint: str) -> int:
    """The layout fingerprint as the 60-bit integer bucket headers carry."""
    return int(fingerprint[:15], 16)


@dataclass(kw_only=True, frozen=True, slots=True)
class Begin:
    step: int
    num_buckets: int

    def encode(self) -> bytes:
        return _BEGIN.pack(self.step, self.num_buckets)

    @classmethod
    def decode(cls, data: bytes) -> Begin:
        step, num_buckets = _BEGIN.unpack(data)
        return cls(step=step, num_buckets=num_buckets)

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


def recv_reply(conn: Connection, timeout: timedelta) -> Reply:
    buf = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    conn.recv(buf, tag=REPLY, timeout=timeout)
    return Reply.decode(buf.numpy().tobytes())


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
