"""The CUDA IPC connection's control frames: their kinds and fixed parts, the limits
on what rides the control socket, and the codec of their variable parts."""

from __future__ import annotations

import struct
from datetime import timedelta

from replica.transport.base import valid_offset
from replica.transport.framing import MAX_FRAME_BYTES
from replica.transport.wire import HEADER_BYTES, BucketHeader

__all__ = [
    "ACK",
    "CUDA_EXPORT",
    "EXPLAIN",
    "EXPORT_FIXED",
    "HOST",
    "HOST_EXPORT",
    "HOST_FIRST_BYTES",
    "HOST_FIXED",
    "HOST_MORE",
    "HOST_OFFER_BYTES",
    "INLINE_COPY_BYTES",
    "IPC_EVENT_HANDLE_BYTES",
    "MAX_EXPORTS",
    "MAX_HOST_BYTES",
    "MAX_IMPORTS",
    "MAX_STAGED_BYTES",
    "OFFER",
    "OFFER_FIXED",
    "PUSHED",
    "PUSHED_FIXED",
    "READY_SPIN",
    "RELEASE",
    "U64",
    "WANT",
    "WANT_FIXED",
    "blobs",
    "digest_offset",
    "read_blobs",
]


# Control frame kinds (the control socket's BYE is 0xFF). A message is named by its tag
# and its index among the messages of that tag (both sides count them alike), so a
# push that completes late is never matched to a later receive.
OFFER = 1  # a bucket to copy out of an export: tag, index, seq, export id, byte offset, nbytes, header [, export]
ACK = 2  # the receiver's copy of send seq has run
HOST = 3  # a host message: tag, index, total bytes, header, first bytes
HOST_MORE = 4  # the next bytes of the host message before it
RELEASE = 5  # this side no longer offers (or receives into) this export: unmap it
WANT = 6  # a receive is posted: tag, index, export id of its buffer (0: none), byte offset, nbytes [, export]
PUSHED = 7  # the sender copied message (tag, index) into the receive's buffer: digest taken?, digest, header

OFFER_FIXED = struct.Struct("<QQQQQQ?")  # tag, index, seq, export id, byte offset in storage, nbytes, export follows
WANT_FIXED = struct.Struct("<QQQQQ?")  # tag, index, export id, byte offset in storage, nbytes, export follows
PUSHED_FIXED = struct.Struct("<QQ?q")  # tag, index, digest taken from the destination, that digest
# An export is a kind byte, then for CUDA: storage bytes, offset of the storage in
# its allocation, ref-counter offset, then three length-prefixed blobs: GPU UUID,
# allocation handle, ref-counter handle; for HOST: a shared-memory region's record.
CUDA_EXPORT = b"\x00"
HOST_EXPORT = b"\x01"
EXPORT_FIXED = struct.Struct("<QQQ")
_BLOB = struct.Struct("<I")
HOST_FIXED = struct.Struct("<QQQ")  # tag, index, total bytes
U64 = struct.Struct("<Q")
HOST_FIRST_BYTES = MAX_FRAME_BYTES - HOST_FIXED.size - HEADER_BYTES

#: Largest host message one send may carry over the control socket (all of them on
#: ``IpcTransport``; on ``ShmTransport`` only those below HOST_OFFER_BYTES go there).
MAX_HOST_BYTES = 64 << 20
#: ShmTransport offers host buckets from this size on as shared memory; smaller ones
#: (the protocol's small messages) ride the control socket, one write instead of a round trip.
HOST_OFFER_BYTES = 64 << 10
#: Free staging regions a ShmTransport connection keeps for the next sends of buffers
#: that are not in shared memory; beyond this the least recently freed are dropped.
MAX_STAGED_BYTES = 1 << 30
#: Exported storages remembered per connection (each stays mapped by the peer);
#: a mirror reuses two snapshot buffers, a weight push a few buckets.
MAX_EXPORTS = 64
# A peer that announces far more exports than a sender keeps is broken.
MAX_IMPORTS = 4 * MAX_EXPORTS
# torch's cudaIpcEventHandle_t size; the event is not used (see Import.map).
IPC_EVENT_HANDLE_BYTES = 64
# Shared-memory buckets up to this size are copied by the thread that matched them (the
# monitor's, or the caller's in irecv): a hand-off to the completion thread costs more.
INLINE_COPY_BYTES = 4 << 20
# How long a copy that failed waits for the control socket to report the peer's death.
EXPLAIN = timedelta(seconds=0.5)
# An event recorded behind finished work completes within microseconds; this
# long the sender looks before handing the offer to the ready thread (a thread
# hop costs tens of microseconds).
READY_SPIN = timedelta(microseconds=20)


def blobs(*blobs: bytes) -> bytes:
    return b"".join(_BLOB.pack(len(b)) + b for b in blobs)


def read_blobs(data: bytes, at: int, n: int) -> tuple[list[bytes], int]:
    out = []
    for _ in range(n):
        (length,) = _BLOB.unpack_from(data, at)
        at += _BLOB.size
        if at + length > len(data):
            raise ValueError("truncated frame")
        out.append(data[at : at + length])
        at += length
    return out, at


def digest_offset(header: bytes) -> int | None:
    """The offset that keys a received bucket's digest, from its header; None when
    the header is bad (the receive's own check then says how)."""
    try:
        offset = BucketHeader.decode(header).offset
    except ValueError:
        return None
    return offset if valid_offset(offset) else None
