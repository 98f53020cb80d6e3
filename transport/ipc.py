"""CUDA IPC backend: processes of one node, device buckets moved GPU to GPU.

A CUDA bucket is complete once its ``ready`` event has (``Connection.isend``'s
``after``: an event the producer recorded, or the caller's current stream at the
call); an offered one goes out as an OFFER frame over the control socket once it has. The first
offer of a storage carries its export (torch's IPC handle, once per storage and
connection); later ones name the export by id. The receiver maps an export
once, and copies device to device into the caller's buffer, on a copy stream
that first waits for the work the caller had queued on the buffer before
``irecv``. The copy is issued by whichever thread completes the match (the
control monitor thread when the offer arrives, the caller's when the offer was
there first), and a per-transport completion thread acknowledges it once it
has run: neither side has to poll for the other to make progress.

The sender waits for its bucket's producers on the host before offering it, so
the receiver never waits on an event of another process: a producer killed
with its work queued cannot leave the receiver's copy stream blocked forever.
An export names its GPU by UUID; the receiver opens it on the receiving
buffer's GPU (with peer access if that is another one) or explains why not.
An export is released (RELEASE frame, then unmapped behind the copies from it)
once its storage is freed or, past MAX_EXPORTS, least recently used, never
while a send of it is in flight.

**A device bucket is pushed, not pulled, wherever the receiver's buffer can be
mapped here** (device memory, or a shared-memory region on ``ShmTransport``): each
receive announces its buffer (a WANT frame, with an export of its storage, once per
storage and connection), and the sender copies its bucket into it from its own
process, on a copy stream of its own (``cudaMemcpyAsync``: the copy engines) that
waits for the bucket's ``ready`` event alone, then says so (PUSHED). The receiver's
process does no GPU work at all: two processes on one GPU are time-sliced between
their contexts, so a copy the receiver issued would wait for the sender's kernels
(a trainer's next step), and a receiver on host memory would need a GPU to copy from
one. Into device memory the sender also takes the digest of the bytes where they
landed (one hash kernel, on the same stream); into host memory the receiver hashes
them on its CPU threads. A receive whose buffer cannot be mapped (plain host memory)
announces none, and the sender offers the bucket as before.

Small host messages (the mirror protocol's layouts, BEGIN, REPLY, FETCH) ride
the control socket itself, in order with the offers and matched by the same
tags, so one IPC connection carries a whole mirror session. On ``IpcTransport``
host payloads are bounded (``MAX_HOST_BYTES``) and its capabilities say CUDA
only.

``ShmTransport`` moves bulk host memory too, with one copy: a host bucket of
``HOST_OFFER_BYTES`` or more is offered like a device bucket, as a memfd region
(``replica.transport.shm``) the receiver maps and copies out of, the bucket's
digest taken by that same copy (``ops.pack_checksum``), then acknowledged. A
bucket already in a region (``shm.shared_empty``: the mirror's snapshots) is
offered where it lies; any other is first copied into a staging region of the
connection. Both sides prove at the handshake that they can map each other's
regions (same user, same PID namespace), or the connection is refused, saying so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replica import ops
from replica.errors import SharedMemoryUnavailableError, TransportError
from replica.transport import shm
from replica.transport.base import Capabilities, Locality, MemoryKind, valid_offset
from replica.transport.control import (
    MAX_FRAME_BYTES,
    ControlledConnection,
    ControlledTransport,
    EndpointConfig,
    exchange_verdicts,
)
from replica.transport.wire import HEADER_BYTES, BucketHeader

__all__ = ["HOST_OFFER_BYTES", "IpcConfig", "IpcConnection", "IpcTransport", "MAX_EXPORTS", "MAX_HOST_BYTES",
           "MAX_STAGED_BYTES", "ShmTransport"]

logger = logging.getLogger(__name__)

# Control frame kinds (the control socket's BYE is 0xFF). A message is named by its tag
# and its index among the messages of that tag (both sides count them alike), so a
# push that completes late is never matched to a later receive.
_OFFER = 1  # a bucket to copy out of an export: tag, index, seq, export id, byte offset, nbytes, header [, export]
_ACK = 2  # the receiver's copy of send seq has run
_HOST = 3  # a host message: tag, index, total bytes, header, first bytes
_HOST_MORE = 4  # the next bytes of the host message before it
_RELEASE = 5  # this side no longer offers (or receives into) this export: unmap it
_WANT = 6  # a receive is posted: tag, index, export id of its buffer (0: none), byte offset, nbytes [, export]
_PUSHED = 7  # the sender copied message (tag, index) into the receive's buffer: digest taken?, digest, header

_OFFER_FIXED = struct.Struct("<QQQQQQ?")  # tag, index, seq, export id, byte offset in storage, nbytes, export follows
_WANT_FIXED = struct.Struct("<QQQQQ?")  # tag, index, export id, byte offset in storage, nbytes, export follows
_PUSHED_FIXED = struct.Struct("<QQ?q")  # tag, index, digest taken from the destination, that digest
# An export is a kind byte, then for CUDA: storage bytes, offset of the storage in
# its allocation, ref-counter offset, then three length-prefixed blobs: GPU UUID,
# allocation handle, ref-counter handle; for HOST: a shared-memory region's record.
_CUDA_EXPORT = b"\x00"
_HOST_EXPORT = b"\x01"
_EXPORT_FIXED = struct.Struct("<QQQ")
_BLOB = struct.Struct("<I")
_HOST_FIXED = struct.Struct("<QQQ")  # tag, index, total bytes
_U64 = struct.Struct("<Q")
_HOST_FIRST_BYTES = MAX_FRAME_BYTES - _HOST_FIXED.size - HEADER_BYTES

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
_MAX_IMPORTS = 4 * MAX_EXPORTS
# torch's cudaIpcEventHandle_t size; the event is not used (see _Import.map).
_IPC_EVENT_HANDLE_BYTES = 64
# Shared-memory buckets up to this size are copied by the thread that matched them (the
# monitor's, or the caller's in irecv): a hand-off to the completion thread costs more.
_INLINE_COPY_BYTES = 4 << 20
# How long a copy that failed waits for the control socket to report the peer's death.
_EXPLAIN_S = 0.5
# An event recorded behind finished work completes within microseconds; this
# long the sender looks before handing the offer to the ready thread (a thread
# hop costs tens of microseconds).
_READY_SPIN_S = 20e-6


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class IpcConfig(EndpointConfig):
    #: Device buckets are copied into the receiver's buffer by the sender's process
    #: (see the module docstring); False: the receiver copies every bucket itself.
    #: Both sides follow the sender's setting.
    push: bool = True
    #: Tests only: bulk host buckets are pushed too (a CPU copy by the sender), so the
    #: push protocol runs on a machine without a GPU. Slower than the receiver's copy
    #: with its digest in the same pass, which host buckets otherwise take.
    push_host: bool = False


@functools.cache
def _uuid_of(device: int) -> bytes:
    return str(torch.cuda.get_device_properties(device).uuid).encode()


@functools.cache
def _local_devices() -> dict[bytes, int]:
    return {_uuid_of(i): i for i in range(torch.cuda.device_count())}


def _blobs(*blobs: bytes) -> bytes:
    return b"".join(_BLOB.pack(len(b)) + b for b in blobs)


def _read_blobs(data: bytes, at: int, n: int) -> tuple[list[bytes], int]:
    out = []
    for _ in range(n):
        (length,) = _BLOB.unpack_from(data, at)
        at += _BLOB.size
        if at + length > len(data):
            raise ValueError("truncated frame")
        out.append(data[at:at + length])
        at += length
    return out, at


def _digest_offset(header: bytes) -> int | None:
    """The offset that keys a received bucket's digest, from its header; None when
    the header is bad (the receive's own check then says how)."""
    try:
        offset = BucketHeader.decode(header).offset
    except ValueError:
        return None
    return offset if valid_offset(offset) else None


# --- per process: copy streams and the threads that wait on events ---


_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()
# Two receives of one export may be delivered at once (monitor and caller
# threads); mapping it twice would hand the exporter two references back.
_map_lock = threading.Lock()


def _completes_soon(event) -> bool:
    deadline = time.perf_counter() + _READY_SPIN_S
    while not event.query():
        if time.perf_counter() >= deadline:
            return False
    return True


def _copy_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The stream receives copy on (one per GPU): copies never queue behind the
    caller's later work, nor the caller's behind them."""
    return _stream(device, "copy", 0)


def _push_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The stream pushes copy on (one per GPU, of the sending process): copies only,
    which run on the copy engines beside the caller's kernels and never queue behind
    a kernel waiting for a multiprocessor (see ``_hash_stream``)."""
    return _stream(device, "push", 0)


def _hash_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The stream the digests of pushed device buckets are taken on, each after its
    copy: high priority, so a digest kernel (microseconds) takes the next free
    multiprocessor ahead of the step's kernels. It still waits for one: a long kernel
    that holds every multiprocessor (a persistent GEMM) holds it back, and on the push
    stream that wait would hold back every copy queued after it."""
    return _stream(device, "hash", -1)


def _stream(device: torch.device | int, kind: str, priority: int) -> torch.cuda.Stream:
    index = device.index if isinstance(device, torch.device) else device
    with _streams_lock:
        stream = _streams.get((index, kind))
        if stream is None:
            stream = _streams[(index, kind)] = torch.cuda.Stream(device=index, priority=priority)
        return stream


class _EventThread:
    """A daemon thread that runs callbacks in order, each once its CUDA event
    (if any) has completed. Started on first use: a host-only transport never
    starts one."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, event, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((event, callback))

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, callback = item
            try:
                if event is not None:
                    event.synchronize()  # releases the GIL
                callback()
            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                logger.exception("%s: callback failed", self._name)
            del item, event, callback  # nothing the callback held outlives it here


# --- sender side ---


class _Export:
    """One storage exported to the peer (torch's IPC handle, taken once)."""

    __slots__ = ("id", "ref", "record", "announced", "inflight")

    def __init__(self, export_id: int, ref, record: bytes):
        self.id = export_id
        self.ref = ref  # StorageWeakRef: the export never keeps the storage alive
        self.record = record  # what the first offer carries
        self.announced = False
        self.inflight = 0  # sends of this storage not yet acknowledged


class _Send:
    """A send: done when acknowledged (an offered bucket) or written (host message)."""

    def __init__(self, keep: Any, export: _Export | None = None,
                 finished: Callable[[], None] | None = None):
        self.completion = threading.Event()
        self.done = False
        self.export = export
        self._keep = keep  # the bucket stays alive until the receiver copied it
        self._finished = finished  # a staging region goes back to its pool

    def finish(self) -> None:
        self.done = True
        self._keep = None
        finished, self._finished = self._finished, None
        if finished is not None:
            finished()
        self.completion.set()

    def poll(self) -> bool:
        return self.done


@dataclass(slots=True)
class _Outgoing:
    ready: Any  # torch.cuda.Event | None: the frames go out once it completed
    frames: list[tuple[int, bytes]]
    written: Callable[[], None] | None = None  # a host message is done once written (a bucket once acknowledged)


@dataclass(slots=True)
class _Bucket:
    """A bucket being sent: pushed into the receiver's buffer, or offered to it."""

    flat: torch.Tensor
    tag: int
    index: int
    seq: int
    head: bytes
    ready: Any  # torch.cuda.Event | None: its producers
    send: _Send


@dataclass(slots=True)
class _Want:
    """A receive the peer posted: where its bytes go (None: a buffer not mapped here)."""

    tag: int
    index: int
    source: Any  # _Import | _HostImport | None
    byte_offset: int
    nbytes: int


# --- receiver side ---


class _HostImport:
    """A shared-memory region of the peer: mapped on first use, dropped on RELEASE
    or close (the mapping goes once the copies from it are done). A region the peer
    receives into is mapped writable (``destination``), page-locked for pushes from a GPU."""

    __slots__ = ("record", "pid", "storage_bytes", "bytes", "dest")

    def __init__(self, record: bytes):
        parsed = shm.parse_record(record)  # TransportError if it is not a record
        self.record, self.pid, self.storage_bytes = record, parsed.pid, parsed.size
        self.bytes: torch.Tensor | None = None
        self.dest: torch.Tensor | None = None

    def destination(self, *, pin: bool) -> torch.Tensor:
        """The region mapped writable (``pin``: and page-locked, for copies from a GPU)."""
        with _map_lock:
            if self.dest is None:
                dest = shm.map_region(self.record, writable=True)
                if pin:
                    shm.pin(dest)
                self.dest = dest
            return self.dest

    def map(self, device: int | None) -> torch.Tensor:
        mapped = self.bytes
        if mapped is not None:
            return mapped
        with _map_lock:
            if self.bytes is None:
                self.bytes = shm.map_region(self.record)
            return self.bytes

    def unmap(self) -> None:
        self.bytes = self.dest = None


class _Import:
    """An export of the peer: mapped on first use, unmapped on RELEASE or close."""

    __slots__ = ("uuid", "handle", "storage_bytes", "storage_offset", "ref_handle", "ref_offset", "bytes")

    def __init__(self, uuid: bytes, handle: bytes, storage_bytes: int, storage_offset: int,
                 ref_handle: bytes, ref_offset: int):
        self.uuid = uuid
        self.handle = handle
        self.storage_bytes = storage_bytes
        self.storage_offset = storage_offset
        self.ref_handle = ref_handle
        self.ref_offset = ref_offset
        self.bytes: torch.Tensor | None = None  # uint8 view of the mapped storage

    def map(self, device: int | None) -> torch.Tensor:
        """The mapped allocation as bytes, opened on ``device`` (the receiving
        buffer's GPU; None: the exporter's GPU as this process numbers it)."""
        mapped = self.bytes
        if mapped is not None:
            return mapped
        with _map_lock:
            if self.bytes is None:
                self.bytes = self._open(device)
            return self.bytes

    def _open(self, device: int | None) -> torch.Tensor:
        source = _local_devices().get(self.uuid)
        if source is None:
            raise TransportError(
                f"the peer's GPU {self.uuid.decode()} is not visible to this process (CUDA_VISIBLE_DEVICES?); "
                "CUDA IPC needs both processes to see the same GPU; use the UCX transport")
        if device is None:
            device = source
        elif device != source and not torch.cuda.can_device_access_peer(device, source):
            raise TransportError(
                f"cuda:{device} cannot access the peer's GPU {self.uuid.decode()} (cuda:{source} here): "
                f"no peer access between them; receive on cuda:{source} or use the UCX transport")
        torch.cuda._lazy_init()
        # The export's own event is not waited on: the sender offers a bucket only
        # once its producers finished, and waiting on another process's event
        # could block this stream forever if that process dies.
        storage = torch.UntypedStorage._new_shared_cuda(
            device, self.handle, self.storage_bytes, self.storage_offset, self.ref_handle, self.ref_offset,
            bytes(_IPC_EVENT_HANDLE_BYTES), False)
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage)

    def unmap(self) -> None:
        """Drop the mapping (torch's deleter hands the exporter its reference
        back), or hand the reference back directly if it was never mapped."""
        if self.bytes is None:
            try:
                torch.UntypedStorage._release_ipc_counter(self.ref_handle, self.ref_offset)
            except Exception as exc:  # noqa: BLE001 - best effort, as in torch: the exporter may be gone
                logger.debug("releasing an unmapped IPC export: %s", exc)
            return
        mapped, self.bytes = self.bytes, None
        # torch's deleter synchronizes the current stream of the mapping's
        # device: make that the copy stream, whose copies from it are done.
        with torch.cuda.stream(_copy_stream(mapped.device)):
            del mapped


@dataclass(slots=True)
class _Offer:
    tag: int
    index: int
    seq: int
    nbytes: int
    byte_offset: int
    header: bytes
    source: _Import | _HostImport


@dataclass(slots=True)
class _HostMessage:
    tag: int
    index: int
    nbytes: int
    header: bytes
    data: bytearray
    filled: int = 0


class _Recv:
    def __init__(self, flat: torch.Tensor, header_buf: torch.Tensor, posted):
        self.flat = flat
        self.header_buf = header_buf
        self.posted = posted  # event after the caller's queued work on flat (CUDA receives)
        self.completion = threading.Event()
        self.done = False
        # Taken by the copy that received it: a shared-memory copy here, or the
        # sender's hash of the bytes it pushed into device memory.
        self.digest: int | None = None
        self.released: Callable[[], None] | None = None  # its buffer's export is not written into any more

    def finish(self, header: bytes) -> None:
        self.header_buf.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.done = True
        self.flat = self.posted = None
        released, self.released = self.released, None
        if released is not None:
            released()
        self.completion.set()

    def poll(self) -> bool:
        return self.done


class IpcConnection(ControlledConnection):
    # One message per bucket: every message costs an offer (or a WANT and a PUSHED), a
    # copy and a frame back through the control socket and a few threads: pieces
    # would only multiply the messages (a mirror stream of 64 MiB buckets moved 50.9
    # GB/s on an H200 in 16 MiB pieces).
    piece_bytes = None

    def __init__(self, *, host_offers: bool = False, probe: torch.Tensor | None = None, peer_pid: int | None = None,
                 push: bool = True, push_host: bool = False, **kwargs):
        # HOST too: small control messages ride the control socket (see the module docstring).
        super().__init__(memory=MemoryKind.HOST | MemoryKind.CUDA, **kwargs)
        self._host_offers = host_offers  # ShmTransport: bulk host buckets go as shared memory
        self._peer_pid = peer_pid  # whose regions alone are mapped: the process the handshake's probe proved
        self._probe = probe  # this side's handshake region, mapped by the peer: kept while connected
        self._push = push  # device buckets go into the receiver's buffer when it can be mapped here
        self._push_host = push_host  # tests only: bulk host buckets too (see IpcConfig.push_host)
        self._staging: list[torch.Tensor] = []  # free staging regions, least recently freed first
        self._staging_lock = threading.Lock()
        self.staged_sends = 0  # host sends that were copied into a staging region first
        self.pushed_sends = 0  # sends copied into the receiver's buffer by this side
        self._push_failure: str | None = None  # why a push failed here once: the rest are offered
        self._seq = itertools.count()
        self._export_ids = itertools.count(1)
        # Lock order: _out_lock, then _state_lock; the monitor thread takes only
        # _state_lock, and no lock but _out_lock is held while a frame is written.
        self._out_lock = threading.Lock()
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._state_lock = threading.Lock()
        self._sends: dict[int, _Send] = {}
        # This side's storages the peer may map, by (storage, address, size): those
        # sent from (offers), and those received into (destinations of WANTs).
        self._exports: collections.OrderedDict[tuple[int, int, int], _Export] = collections.OrderedDict()
        self._dest_exports: collections.OrderedDict[tuple[int, int, int], _Export] = collections.OrderedDict()
        # Messages by (tag, index): receives posted, and messages that came before theirs.
        self._sent: dict[int, int] = collections.defaultdict(int)
        self._received: dict[int, int] = collections.defaultdict(int)
        self._waiting: dict[tuple[int, int], _Recv] = {}
        self._unmatched: dict[tuple[int, int], _Offer | _HostMessage] = {}
        # The peer's receives not yet matched by a send here, and sends waiting for the peer's receive.
        self._wants: dict[tuple[int, int], _Want] = {}
        self._pushes: dict[tuple[int, int], _Bucket] = {}
        # The peer's storages: those it offers (imports), those it receives into (destinations).
        self._imports: dict[int, _Import | _HostImport] = {}
        self._destinations: dict[int, _Import | _HostImport] = {}
        self._partial: _HostMessage | None = None  # monitor thread only

    # For tests and diagnostics:
    @property
    def num_exports(self) -> int:
        """Storages this side has offered to the peer."""
        return self._count(self._exports)

    @property
    def num_imports(self) -> int:
        """Offered exports of the peer this side holds (mapped or not yet used)."""
        return self._count(self._imports)

    @property
    def num_dest_exports(self) -> int:
        """Storages this side receives into that the peer may map and push into."""
        return self._count(self._dest_exports)

    @property
    def num_dest_imports(self) -> int:
        """The peer's receive buffers this side holds, to push into."""
        return self._count(self._destinations)

    def _count(self, table) -> int:
        with self._state_lock:
            return len(table)

    # --- sending ---

    def _isend(self, flat, tag, header, ready):
        if flat.numel() == 0 or (flat.device.type == "cpu" and not self._offers_host(flat)):
            return self._send_host(flat, tag, header)
        if self._push and (flat.device.type == "cuda" or self._push_host):
            return self._send_push(flat, tag, header, ready)
        head = header()
        send = _Send((flat, ready))
        with self._state_lock:
            item = _Bucket(flat=flat, tag=tag, index=self._next_index(tag), seq=next(self._seq), head=head,
                           ready=ready, send=send)
            self._sends[item.seq] = send
        self._offer(item)
        return send

    def _next_index(self, tag: int) -> int:
        """The index of the next send under ``tag``; a WANT that came for it is dropped
        (a send that does not wait for the receive). Caller holds _state_lock."""
        index = self._sent[tag]
        self._sent[tag] = index + 1
        self._wants.pop((tag, index), None)
        return index

    def _offers_host(self, flat: torch.Tensor) -> bool:
        return self._host_offers and flat.numel() >= HOST_OFFER_BYTES

    def _check_bucket(self, flat: torch.Tensor) -> None:
        # Per bucket, not per piece: a bucket over the limit is refused before any piece goes.
        nbytes = flat.numel()
        if flat.device.type == "cpu" and nbytes > MAX_HOST_BYTES and not self._offers_host(flat):
            raise TransportError(
                f"a {nbytes}-byte host message is over CUDA IPC's limit of {MAX_HOST_BYTES} bytes "
                "(host messages ride the control socket); send device memory, or use the UCX transport")

    def _send_host(self, flat: torch.Tensor, tag: int, header: Callable[[], bytes]) -> _Send:
        nbytes = flat.numel()
        head = header()
        data = flat.numpy().tobytes() if nbytes else b""
        send = _Send(None)
        with self._out_lock:
            with self._state_lock:
                index = self._next_index(tag)
                seq = next(self._seq)
                self._sends[seq] = send
            frames = [(_HOST, _HOST_FIXED.pack(tag, index, nbytes) + head + data[:_HOST_FIRST_BYTES])]
            frames += [(_HOST_MORE, data[at:at + MAX_FRAME_BYTES])
                       for at in range(_HOST_FIRST_BYTES, nbytes, MAX_FRAME_BYTES)]
            self._post(_Outgoing(ready=None, frames=frames, written=functools.partial(self._written, seq, send)))
        return send

    def _written(self, seq: int, send: _Send) -> None:
        with self._state_lock:
            self._sends.pop(seq, None)
        send.finish()

    def _send_push(self, flat: torch.Tensor, tag: int, header: Callable[[], bytes], ready) -> _Send:
        """A bucket for the receive the peer posts (or posted) under the same tag and
        index: pushed into its buffer if that can be mapped here, else offered."""
        head = header()  # here, in the caller's thread (it may hash the bucket; see Connection.isend)
        send = _Send((flat, ready))
        with self._state_lock:
            if self._error is not None:
                raise self._error
            index = self._sent[tag]
            self._sent[tag] = index + 1
            item = _Bucket(flat=flat, tag=tag, index=index, seq=next(self._seq), head=head, ready=ready, send=send)
            self._sends[item.seq] = send
            want = self._wants.pop((tag, index), None)
            if want is None:
                self._pushes[(tag, index)] = item
        if want is not None:
            self._transport._pusher.submit(None, functools.partial(self._dispatch, item, want))
        return send

    def _dispatch(self, item: _Bucket, want: _Want) -> None:
        """Pusher thread: copy ``item`` into the peer's receive buffer, or offer it
        when that buffer cannot be mapped here (or a push failed on this connection)."""
        if self._error is not None:
            return  # its waiter was woken with the connection's error
        source, flat = want.source, item.flat
        if source is None or self._push_failure is not None or (
                isinstance(source, _Import) and flat.device.type != "cuda"):
            self._offer(item)
            return
        n = min(flat.numel(), want.nbytes)  # a size mismatch fails the receive's check
        offset = _digest_offset(item.head) if self._verify_digests else None
        digest = None
        try:
            if isinstance(source, _Import):
                full = source.map(None)
            else:
                full = source.destination(pin=flat.device.type == "cuda")
            dst, src = full[want.byte_offset:want.byte_offset + n], flat[:n]
            if flat.device.type == "cuda":
                stream = _push_stream(flat.device)
                if item.ready is not None:
                    stream.wait_event(item.ready)  # its producers alone, never a thread's current stream
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                copied = torch.cuda.Event(blocking=True)
                copied.record(stream)
                if dst.device.type == "cuda" and offset is not None and n:
                    # The bytes where they landed, hashed here: the receiver's process
                    # does no GPU work (see the module docstring).
                    hashing = _hash_stream(flat.device)
                    hashing.wait_event(copied)
                    with torch.cuda.stream(hashing):
                        taken = ops.checksum(dst, -(-n // 8) * 8, offset // 8)
                        digest = torch.empty(1, dtype=torch.int64, pin_memory=True)
                        digest.copy_(taken, non_blocking=True)
                    copied = torch.cuda.Event(blocking=True)
                    copied.record(hashing)
            else:  # push_host: a host copy, the receiver hashes it
                dst.copy_(src)
                copied = None
        except Exception as exc:  # noqa: BLE001 - the peer can still copy the bucket itself
            if self._error is not None:
                return
            self._push_failure = str(exc)
            logger.warning("cannot copy into the buffers of %s (%s); offering it its buckets to copy instead",
                           self.peer, exc)
            self._offer(item)
            return
        with self._state_lock:
            self.pushed_sends += 1
        # The bucket, the mapping and the digest stay referenced until the copy has run.
        self._transport._copied.submit(copied, functools.partial(self._pushed, item, digest, (src, dst, full)))

    def _pushed(self, item: _Bucket, digest: torch.Tensor | None, keep) -> None:
        """Completion thread: ``item``'s copy into the peer's buffer has run; tell the peer."""
        taken = digest is not None
        frame = _PUSHED_FIXED.pack(item.tag, item.index, taken, int(digest[0]) if taken else 0) + item.head
        try:
            self._send_control(_PUSHED, frame)
        except TransportError:
            return  # the peer is gone; the send's waiter sees the connection's error
        self._written(item.seq, item.send)

    def _offer(self, item: _Bucket) -> None:
        """Offer a bucket (a device bucket, or a host bucket as shared memory) for the peer to copy."""
        flat, finished = item.flat, None
        if flat.device.type == "cpu" and shm.region_of(flat) is None:
            flat, finished = self._stage(flat)
            item.send._finished = finished
        storage = flat.untyped_storage()
        with self._out_lock:
            export = self._export(storage, flat, self._exports)
            item.send._keep = (flat, item.ready)
            item.send.export = export
            with self._state_lock:
                export.inflight += 1  # first: an export in flight is never retired
            frames = self._retire_exports(self._exports, storage)
            fixed = _OFFER_FIXED.pack(item.tag, item.index, item.seq, export.id, flat.storage_offset(), flat.numel(),
                                      not export.announced)
            frames.append((_OFFER, fixed + item.head + (b"" if export.announced else export.record)))
            export.announced = True
            self._post(_Outgoing(ready=item.ready, frames=frames))

    def _stage(self, flat: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A copy of ``flat`` in a staging region (reused from the pool when one is
        large enough), and what gives the region back once the send is acknowledged."""
        n = flat.numel()
        with self._staging_lock:
            fits = [i for i, r in enumerate(self._staging) if r.numel() >= n]  # by index: tensors compare by value
            region = self._staging.pop(min(fits, key=lambda i: self._staging[i].numel())) if fits else None
            self.staged_sends += 1
        if region is None:
            region = shm.shared_empty(max(n, HOST_OFFER_BYTES))
        staged = region[:n]
        staged.copy_(flat)

        def give_back() -> None:
            with self._staging_lock:
                if self._error is not None:
                    return
                self._staging.append(region)
                while sum(r.numel() for r in self._staging) > MAX_STAGED_BYTES:
                    self._staging.pop(0)
        return staged, give_back

    def _export(self, storage: torch.UntypedStorage, flat: torch.Tensor,
                table: collections.OrderedDict[tuple[int, int, int], _Export]) -> _Export:
        """This storage's export in ``table`` (offers or destinations); taken once
        (torch nests a new ref-counter and event into the storage on every
        ``_share_cuda_``). Caller holds _out_lock."""
        key = (storage._cdata, storage.data_ptr(), storage.nbytes())
        with self._state_lock:
            export = table.get(key)
            if export is not None:
                # The weak reference keeps the StorageImpl's address from being
                # reused, so the same _cdata means the same, live storage.
                table.move_to_end(key)
                return export
        from torch.multiprocessing.reductions import StorageWeakRef

        if flat.device.type == "cpu":
            region = shm.region_of(flat)
            if region is None or region.offset != flat.storage_offset():
                raise TransportError("a host bucket offered that is not in a shared-memory region of its own")
            record = _HOST_EXPORT + region.record
        else:
            try:
                (_, handle, storage_bytes, storage_offset, ref_handle, ref_offset, _event,
                 _sync) = storage._share_cuda_()
            except RuntimeError as exc:
                raise TransportError(f"cannot export this CUDA buffer for IPC ({exc}); use the UCX transport") from exc
            record = (_CUDA_EXPORT + _EXPORT_FIXED.pack(storage_bytes, storage_offset, ref_offset)
                      + _blobs(_uuid_of(flat.device.index), handle, ref_handle))
        export = _Export(next(self._export_ids), StorageWeakRef(storage), record)
        with self._state_lock:
            table[key] = export
        return export

    def _retire_exports(self, table: collections.OrderedDict[tuple[int, int, int], _Export],
                        using: torch.UntypedStorage) -> list[tuple[int, bytes]]:
        """RELEASE frames for the exports of ``table`` whose storage is gone, those of
        the storage in use that it has left (a resize moved its bytes), and, past
        MAX_EXPORTS, the least recently used ones; never one in use (a send or a
        receive in flight). Caller holds _out_lock."""
        frames = []
        moved = using._cdata
        with self._state_lock:
            over = len(table) - MAX_EXPORTS
            for key, export in list(table.items()):
                if export.inflight:
                    continue
                if over > 0 or key[0] == moved or export.ref.expired():
                    del table[key]
                    over -= 1
                    if export.announced:
                        frames.append((_RELEASE, _U64.pack(export.id)))
        return frames

    def _post(self, item: _Outgoing) -> None:
        """Write the item now if nothing is queued before it and its bucket is
        ready, else queue it for the ready thread. Caller holds _out_lock."""
        if not self._outbox and (item.ready is None or _completes_soon(item.ready)):
            self._write(item)
        else:
            self._outbox.append(item)
            self._transport._ready.submit(item.ready, self._flush)

    def _flush(self) -> None:
        """Ready thread: write the queued items whose buckets are ready, in order."""
        with self._out_lock:
            while self._outbox and (self._outbox[0].ready is None or self._outbox[0].ready.query()):
                self._write(self._outbox.popleft())

    def _write(self, item: _Outgoing) -> None:
        try:
            for kind, payload in item.frames:
                self._send_control(kind, payload)
        except TransportError:
            return  # the connection failed; its waiters were woken
        if item.written is not None:
            item.written()

    # --- receiving ---

    def _irecv(self, flat, tag, header_buf, ready):
        receive = _Recv(flat, header_buf, ready)
        with self._state_lock:
            if self._error is not None:
                raise self._error
            index = self._received[tag]
            self._received[tag] = index + 1
            message = self._unmatched.pop((tag, index), None)
            if message is None:
                self._waiting[(tag, index)] = receive
        if message is not None:
            self._deliver(receive, message)
        else:
            self._want(receive, flat, tag, index, ready)
        return receive

    def _destination(self, flat: torch.Tensor) -> bool:
        """Whether the peer may map ``flat`` and push into it."""
        if not self._push or flat.numel() == 0:
            return False
        if flat.device.type == "cuda":
            return True
        return self._offers_host(flat) and shm.region_of(flat) is not None

    def _want(self, receive: _Recv, flat: torch.Tensor, tag: int, index: int, ready) -> None:
        """Tell the peer this receive is posted, with its buffer's export when it may push into it."""
        export, frames = None, []
        with self._out_lock:
            if self._destination(flat):
                storage = flat.untyped_storage()
                try:
                    export = self._export(storage, flat, self._dest_exports)
                except TransportError as exc:
                    logger.debug("a receive buffer the peer cannot map (%s): it offers instead", exc)
                else:
                    with self._state_lock:
                        export.inflight += 1  # not retired while the peer may write into it
                    receive.released = functools.partial(self._release_destination, export)
                    frames = self._retire_exports(self._dest_exports, storage)
            announce = export is not None and not export.announced
            fixed = _WANT_FIXED.pack(tag, index, export.id if export is not None else 0,
                                     flat.storage_offset() if export is not None else 0, flat.numel(), announce)
            frames.append((_WANT, fixed + (export.record if announce else b"")))
            if export is not None:
                export.announced = True
            # The peer writes into the buffer once it has the WANT: not before the work
            # queued on it has run (a host wait on the ready thread; never an event of
            # another process, whose death could leave this one's stream blocked).
            self._post(_Outgoing(ready=ready if export is not None else None, frames=frames))

    def _release_destination(self, export: _Export) -> None:
        with self._state_lock:
            export.inflight -= 1

    def _on_control(self, kind, payload):
        if kind == _ACK:
            (seq,) = _U64.unpack(payload)
            with self._state_lock:
                send = self._sends.pop(seq, None)
                if send is not None and send.export is not None:
                    send.export.inflight -= 1
            if send is None:
                raise TransportError(f"acknowledgement of unknown send {seq}")
            send.finish()
        elif kind == _OFFER:
            self._match(self._decode_offer(payload))
        elif kind == _WANT:
            self._on_want(payload)
        elif kind == _PUSHED:
            tag, index, taken, digest = _PUSHED_FIXED.unpack_from(payload)
            header = payload[_PUSHED_FIXED.size:_PUSHED_FIXED.size + HEADER_BYTES]
            with self._state_lock:
                receive = self._waiting.pop((tag, index), None)
            if receive is None:
                raise TransportError(f"a push of tag {tag} message {index} into no posted receive")
            if taken:
                receive.digest = digest
            receive.finish(header)
        elif kind == _HOST:
            tag, index, nbytes = _HOST_FIXED.unpack_from(payload)
            if self._partial is not None:
                raise TransportError("a host message began inside another")
            if nbytes > MAX_HOST_BYTES:
                raise TransportError(f"peer announced a {nbytes}-byte host message")
            at = _HOST_FIXED.size + HEADER_BYTES
            self._partial = _HostMessage(tag=tag, index=index, nbytes=nbytes, header=payload[_HOST_FIXED.size:at],
                                         data=bytearray(nbytes))
            self._host_bytes(payload, at)
        elif kind == _HOST_MORE:
            if self._partial is None:
                raise TransportError("host message bytes without a host message")
            self._host_bytes(payload, 0)
        elif kind == _RELEASE:
            (export_id,) = _U64.unpack(payload)
            with self._state_lock:
                source = self._imports.pop(export_id, None) or self._destinations.pop(export_id, None)
            if source is None:
                raise TransportError(f"release of unknown export {export_id}")
            # After the copies queued before it: the peer releases an export only once
            # every send of it was acknowledged (copied), or every receive into it finished.
            self._transport._copied.submit(None, source.unmap)
        else:
            super()._on_control(kind, payload)

    def _on_want(self, payload: bytes) -> None:
        tag, index, export_id, byte_offset, nbytes, announces = _WANT_FIXED.unpack_from(payload)
        source = None
        if export_id:
            with self._state_lock:
                source = self._destinations.get(export_id)
            if announces:
                if source is not None:
                    raise TransportError(f"export {export_id} announced twice")
                source = self._decode_export(payload, _WANT_FIXED.size, mapped=False)
                with self._state_lock:
                    if len(self._destinations) >= _MAX_IMPORTS:
                        raise TransportError(f"peer exported more than {_MAX_IMPORTS} receive buffers without "
                                             "releasing any")
                    self._destinations[export_id] = source
            elif source is None:
                raise TransportError(f"a receive into unknown export {export_id}")
            if byte_offset + nbytes > source.storage_bytes:
                raise TransportError(f"a receive into bytes [{byte_offset}, {byte_offset + nbytes}) of a "
                                     f"{source.storage_bytes}-byte storage")
        want = _Want(tag=tag, index=index, source=source, byte_offset=byte_offset, nbytes=nbytes)
        with self._state_lock:
            item = self._pushes.pop((tag, index), None)
            if item is None:
                if index >= self._sent[tag]:  # else its send went without waiting for it
                    self._wants[(tag, index)] = want
                return
        # Mapping and copying are the pusher thread's: this one reads the peer's frames (and its death).
        self._transport._pusher.submit(None, functools.partial(self._dispatch, item, want))

    def _host_bytes(self, payload: bytes, at: int) -> None:
        message = self._partial
        n = len(payload) - at
        if message.filled + n > message.nbytes:
            raise TransportError("a host message ran past its announced size")
        message.data[message.filled:message.filled + n] = memoryview(payload)[at:]
        message.filled += n
        if message.filled == message.nbytes:
            self._partial = None
            self._match(message)

    def _decode_export(self, payload: bytes, at: int, *, mapped: bool) -> _Import | _HostImport:
        """An export record at ``payload[at:]``. ``mapped``: a region the peer offers is
        mapped at once (it can be opened only while its owner lives, and once mapped it
        outlives its owner); the peer's receive buffers are mapped on the first push."""
        kind, at = payload[at:at + 1], at + 1
        if kind == _HOST_EXPORT:
            if not self._host_offers:
                raise TransportError("a shared-memory export on a connection that takes none")
            source = _HostImport(payload[at:])
            if source.pid != self._peer_pid:
                raise TransportError("a shared-memory export of a region another process made")
            if mapped:  # the copy says why if this failed
                with contextlib.suppress(TransportError):
                    source.map(None)
            return source
        if kind == _CUDA_EXPORT:
            storage_bytes, storage_offset, ref_offset = _EXPORT_FIXED.unpack_from(payload, at)
            (uuid, handle, ref_handle), _ = _read_blobs(payload, at + _EXPORT_FIXED.size, 3)
            return _Import(uuid, handle, storage_bytes, storage_offset, ref_handle, ref_offset)
        raise TransportError(f"an export of unknown kind {kind!r}")

    def _decode_offer(self, payload: bytes) -> _Offer:
        tag, index, seq, export_id, byte_offset, nbytes, announces = _OFFER_FIXED.unpack_from(payload)
        at = _OFFER_FIXED.size + HEADER_BYTES
        header = payload[_OFFER_FIXED.size:at]
        with self._state_lock:
            source = self._imports.get(export_id)
        if announces:
            if source is not None:
                raise TransportError(f"export {export_id} announced twice")
            source = self._decode_export(payload, at, mapped=True)
            with self._state_lock:
                if len(self._imports) >= _MAX_IMPORTS:
                    raise TransportError(f"peer exported more than {_MAX_IMPORTS} storages without releasing any")
                self._imports[export_id] = source
        elif source is None:
            raise TransportError(f"offer of unknown export {export_id}")
        if byte_offset + nbytes > source.storage_bytes:
            raise TransportError(f"offer of bytes [{byte_offset}, {byte_offset + nbytes}) of a "
                                 f"{source.storage_bytes}-byte storage")
        return _Offer(tag=tag, index=index, seq=seq, nbytes=nbytes, byte_offset=byte_offset, header=header,
                      source=source)

    def _match(self, message: _Offer | _HostMessage) -> None:
        key = (message.tag, message.index)
        with self._state_lock:
            receive = self._waiting.pop(key, None)
            if receive is None:
                if key in self._unmatched:
                    raise TransportError(f"tag {message.tag} message {message.index} arrived twice")
                self._unmatched[key] = message
        if receive is not None:
            self._deliver(receive, message)

    def _deliver(self, receive: _Recv, message: _Offer | _HostMessage) -> None:
        """Copy a matched message into its receive buffer: at once for host
        bytes into host memory, else on the copy stream, finished by the
        completion thread (which also acknowledges offers)."""
        flat = receive.flat
        n = min(flat.numel(), message.nbytes)  # a size mismatch fails the receive's check
        try:
            if isinstance(message, _HostMessage):
                if n == 0 or flat.device.type == "cpu":
                    if n:
                        flat[:n].copy_(torch.frombuffer(message.data, dtype=torch.uint8, count=n))
                    receive.finish(message.header)
                    return
                src = torch.frombuffer(message.data, dtype=torch.uint8, count=n)
            elif isinstance(message.source, _HostImport) and flat.device.type == "cpu":
                if n <= _INLINE_COPY_BYTES and message.source.bytes is not None:
                    self._copy_shared(receive, message, n, inline=True)
                else:  # off the monitor thread, which reads the peer's frames (and its death)
                    self._transport._copied.submit(None, functools.partial(self._copy_shared, receive, message, n))
                return
            else:
                mapped = message.source.map(flat.device.index if flat.device.type == "cuda" else None)
                src = mapped[message.byte_offset:message.byte_offset + n]
            device = flat.device if flat.device.type == "cuda" else src.device
            stream = _copy_stream(device)
            if receive.posted is not None:
                stream.wait_event(receive.posted)
            with torch.cuda.stream(stream):
                flat[:n].copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        except Exception as exc:  # noqa: BLE001 - a failed copy fails the connection, not the thread
            receive.completion.set()
            self._fail(exc if isinstance(exc, TransportError) else
                       TransportError(f"receiving tag {message.tag} from {self.peer} failed: {exc}"))
            return
        # src (the mapping) and flat stay referenced until the copy has run.
        self._transport._copied.submit(copied, functools.partial(self._copied, receive, message, src, flat))

    def _copy_shared(self, receive: _Recv, message: _Offer, n: int, *, inline: bool = False) -> None:
        """Copy a shared-memory bucket out of the peer's region, hashing it in the same
        pass when digests are on, then acknowledge it. On the completion thread, or
        ``inline`` in the thread that matched it (a small bucket of a region mapped already)."""
        flat = receive.flat
        if flat is None or self._error is not None:
            return  # the connection failed: its waiters were woken, the buffer is theirs again
        try:
            src = message.source.map(None)[message.byte_offset:message.byte_offset + n]
            offset = _digest_offset(message.header) if self._verify_digests else None
            if offset is None:
                flat[:n].copy_(src)
            else:
                receive.digest = int(ops.pack_checksum([src], flat[:n], [0], -(-n // 8) * 8, offset // 8)[0])
        except Exception as exc:  # noqa: BLE001 - a failed copy fails the connection, not the thread
            # A region that cannot be opened any more most often means its owner died:
            # the control socket says so within moments, and then that is the error.
            if inline or not self._failed.wait(_EXPLAIN_S):
                self._fail(exc if isinstance(exc, TransportError) else
                           TransportError(f"receiving tag {message.tag} from {self.peer} failed: {exc}"))
            receive.completion.set()
            return
        del src
        self._copied(receive, message, None, None)

    def _copied(self, receive: _Recv, message: _Offer | _HostMessage, src, flat) -> None:
        # src and flat are only held: their last references drop after this returns.
        receive.finish(message.header)
        if isinstance(message, _Offer):
            try:
                self._send_control(_ACK, _U64.pack(message.seq))
            except TransportError:
                pass  # the peer is gone; it no longer waits for the acknowledgement

    def _release(self) -> None:
        with self._state_lock:
            pending = list(self._sends.values()) + list(self._waiting.values())
            imports = list(self._imports.values()) + list(self._destinations.values())
            self._sends.clear()
            self._waiting.clear()
            self._unmatched.clear()
            self._wants.clear()
            self._pushes.clear()
            self._imports.clear()
            self._destinations.clear()
            self._exports.clear()
            self._dest_exports.clear()
        with self._staging_lock:
            self._staging.clear()
        self._outbox.clear()  # without _out_lock: a writer holding it may be what failed
        for p in pending:
            p.completion.set()  # waiters see the connection's error
        for source in imports:
            # Queued behind the copies still running from it: never unmapped under a copy.
            self._transport._copied.submit(None, source.unmap)


class IpcTransport(ControlledTransport):
    """CUDA IPC between processes of one node. Its capabilities say CUDA only:
    host messages travel too, but only up to MAX_HOST_BYTES (over the control
    socket), so a host mirror must choose another backend.

    One ready thread, one pusher thread and one completion thread per transport
    serve all its connections, in order: an offer whose producers are still
    running delays the offers queued after it, on every connection of this
    transport (a push waits for its producers on its copy stream, not here)."""

    capabilities = Capabilities(memory=MemoryKind.CUDA, locality=Locality.SAME_NODE)

    def __init__(self, config: IpcConfig):
        super().__init__(config)
        self.config = config
        # Offers wait for their buckets' producers here; pushes are mapped and issued
        # here; receives' copies and pushes are finished here.
        self._ready = _EventThread("replica-ipc-ready")
        self._pusher = _EventThread("replica-ipc-push")
        self._copied = _EventThread("replica-ipc-copied")

    def _offer(self, server, locality):
        if locality is not Locality.SAME_NODE:
            raise TransportError("CUDA IPC reaches processes on this host only; the peer is on another "
                                 "(use the UCX transport)")
        return b"", None

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        return IpcConnection(transport=self, sock=sock, peer=peer, verify=self.config.verify,
                             verify_threads=self.config.verify_threads, push=self.config.push,
                             push_host=self.config.push_host, **self._host_path(peer, peer_offer, state))

    def _host_path(self, peer: str, peer_offer: bytes, state: Any) -> dict[str, Any]:
        """What the connection needs for host buckets beyond the control socket: none here."""
        return {}

    def _shutdown(self) -> None:
        self._ready.close()
        self._pusher.close()
        self._copied.close()  # after the connections queued their unmaps


_PROBE_NONCE_BYTES = 16


class ShmTransport(IpcTransport):
    """``IpcTransport`` that moves bulk host memory too, as shared memory with one
    copy (see the module docstring): the backend for host buckets between processes
    of one node that run as the same user in the same PID namespace. Its handshake
    proves that: each side maps a region the other made and checks its bytes, or
    the connection is refused with the reason (then use UCX)."""

    capabilities = Capabilities(memory=MemoryKind.HOST | MemoryKind.CUDA, locality=Locality.SAME_NODE)

    def _offer(self, server, locality):
        super()._offer(server, locality)
        try:
            probe = shm.shared_empty(_PROBE_NONCE_BYTES)
        except OSError as exc:  # no memfd here (out of descriptors, a seccomp filter)
            if not server:  # refused before anything is sent: the connector takes the fallback
                raise SharedMemoryUnavailableError(f"cannot make shared memory here: {exc}") from exc
            logger.warning("cannot make shared memory for a peer's handshake (%s): refusing it", exc)
            return b"", None  # no region offered: both sides refuse (see _open)
        probe.copy_(torch.frombuffer(bytearray(os.urandom(_PROBE_NONCE_BYTES)), dtype=torch.uint8))
        region = shm.region_of(probe)
        return region.record + probe.numpy().tobytes(), probe

    def _host_path(self, peer, peer_offer, state):
        return {"host_offers": True, "probe": state, "peer_pid": shm.parse_record(peer_offer[:shm.RECORD_BYTES]).pid}

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        # Both sides say whether they could map the other's probe before either uses the
        # connection: a refusal seen on one side only (the peer in a PID namespace nested
        # in this one maps this side's region; this side cannot map its) is then seen by
        # both, and each raises SharedMemoryUnavailableError, which a connector can answer
        # by taking another backend.
        # Neither side sends a verdict where either offered no region: this side could not make
        # its own (a server out of memfds), or the peer is none (or could not make one).
        if state is None:
            raise SharedMemoryUnavailableError(f"cannot share host memory with {peer}: this side could not make "
                                               "a shared-memory region")
        if len(peer_offer) != shm.RECORD_BYTES + _PROBE_NONCE_BYTES:
            raise SharedMemoryUnavailableError(f"cannot share host memory with {peer}: it offers no region to map "
                                               "(it could not make one, or it is not a shared-memory peer)")
        reason = self._check_probe(peer_offer)
        peer_reason = exchange_verdicts(sock, reason, peer=peer, timeout_s=timeout_s)
        if reason or peer_reason:
            raise SharedMemoryUnavailableError(
                f"cannot share host memory with {peer}: "
                + (reason or f"it could not map this side's region ({peer_reason})"))
        return super()._open(sock=sock, peer=peer, peer_offer=peer_offer, send_id=send_id, recv_id=recv_id,
                             server=server, state=state, timeout_s=timeout_s)

    @staticmethod
    def _check_probe(peer_offer: bytes) -> str:
        """Why the peer's probe region cannot be mapped and read back here ("" when it can)."""
        record, nonce = peer_offer[:shm.RECORD_BYTES], peer_offer[shm.RECORD_BYTES:]
        try:
            mapped = shm.map_region(record)
        except TransportError as exc:
            return str(exc)
        if mapped[:_PROBE_NONCE_BYTES].numpy().tobytes() != nonce:
            return ("the region it offered does not hold what it said (another PID namespace?); "
                    "use the UCX transport")
        return ""
