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

import torch

__all__ = [
    "BEGIN",
    "BUCKET_BASE",
    "Begin",
    "LAYOUT",
    "LAYOUT_SIZE",
    "MAX_REPORTED",
    "REPLY",
    "REPLY_BYTES",
    "Reply",
    "Status",
    "as_tensor",
    "fingerprint_int",
]

LAYOUT_SIZE = 1
LAYOUT = 2
BEGIN = 3
REPLY = 4
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
