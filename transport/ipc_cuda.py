"""The CUDA IPC connection's per-process machinery (its copy streams, the threads that
wait on events), the records of each side (exports offered and mapped, sends,
receives and the messages they match), and what its two halves share (``IpcState``)."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from replica.errors import TransportError
from replica.transport import memfd
from replica.transport.control import ControlledConnection
from replica.transport.ipc_frames import IPC_EVENT_HANDLE_BYTES, READY_SPIN

if TYPE_CHECKING:
    from replica.transport.ipc import IpcTransport

__all__ = [
    "Bucket",
    "EventThread",
    "Export",
    "HostImport",
    "HostMessage",
    "Import",
    "IpcState",
    "Offer",
    "Outgoing",
    "Recv",
    "Send",
    "Want",
    "completes_soon",
    "copy_stream",
    "hash_stream",
    "push_stream",
    "uuid_of",
]

logger = logging.getLogger(__name__)


@functools.cache
def uuid_of(device: int) -> bytes:
    return str(torch.cuda.get_device_properties(device).uuid).encode()


@functools.cache
def _local_devices() -> dict[bytes, int]:
    return {uuid_of(i): i for i in range(torch.cuda.device_count())}


# --- per process: copy streams and the threads that wait on events ---


_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()
# Two receives of one export may be delivered at once (monitor and caller
# threads); mapping it twice would hand the exporter two references back.
_map_lock = threading.Lock()


def completes_soon(event) -> bool:
    deadline = time.perf_counter() + READY_SPIN.total_seconds()  # a spin of microseconds: perf_counter's resolution
    while not event.query():
        if time.perf_counter() >= deadline:
            return False
    return True


def copy_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The stream receives copy on (one per GPU): copies never queue behind the
    caller's later work, nor the caller's behind them."""
    return _stream(device, "copy", 0)


def push_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The stream pushes copy on (one per GPU, of the sending process): copies only,
    which run on the copy engines beside the caller's kernels and never queue behind
    a kernel waiting for a multiprocessor (see ``hash_stream``)."""
    return _stream(device, "push", 0)


def hash_stream(device: torch.device | int) -> torch.cuda.Stream:
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


class EventThread:
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
            except Exception:
                logger.exception("%s: callback failed", self._name)
            del item, event, callback  # nothing the callback held outlives it here


# --- sender side ---


class Export:
    """One storage exported to the peer (torch's IPC handle, taken once)."""

    __slots__ = ("id", "ref", "record", "announced", "inflight")

    def __init__(self, export_id: int, ref, record: bytes):
        self.id = export_id
        self.ref = ref  # StorageWeakRef: the export never keeps the storage alive
        self.record = record  # what the first offer carries
        self.announced = False
        self.inflight = 0  # sends of this storage not yet acknowledged


class Send:
    """A send: done when acknowledged (an offered bucket) or written (host message)."""

    def __init__(self, keep: Any, export: Export | None = None, finished: Callable[[], None] | None = None):
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
class Outgoing:
    ready: Any  # torch.cuda.Event | None: the frames go out once it completed
    frames: list[tuple[int, bytes]]
    written: Callable[[], None] | None = None  # a host message is done once written (a bucket once acknowledged)


@dataclass(slots=True)
class Bucket:
    """A bucket being sent: pushed into the receiver's buffer, or offered to it."""

    flat: torch.Tensor
    tag: int
    index: int
    seq: int
    head: bytes
    ready: Any  # torch.cuda.Event | None: its producers
    send: Send


@dataclass(slots=True)
class Want:
    """A receive the peer posted: where its bytes go (None: a buffer not mapped here)."""

    tag: int
    index: int
    source: Any  # Import | HostImport | None
    byte_offset: int
    nbytes: int


# --- receiver side ---


class HostImport:
    """A shared-memory region of the peer: mapped on first use, dropped on RELEASE
    or close (the mapping goes once the copies from it are done). A region the peer
    receives into is mapped writable (``destination``), page-locked for pushes from a GPU."""

    __slots__ = ("record", "pid", "storage_bytes", "bytes", "dest")

    def __init__(self, record: bytes):
        parsed = memfd.parse_record(record)  # TransportError if it is not a record
        self.record, self.pid, self.storage_bytes = record, parsed.pid, parsed.size
        self.bytes: torch.Tensor | None = None
        self.dest: torch.Tensor | None = None

    def destination(self, *, pin: bool) -> torch.Tensor:
        """The region mapped writable (``pin``: and page-locked, for copies from a GPU)."""
        with _map_lock:
            if self.dest is None:
                dest = memfd.map_region(self.record, writable=True)
                if pin:
                    memfd.pin(dest)
                self.dest = dest
            return self.dest

    def map(self, device: int | None) -> torch.Tensor:
        mapped = self.bytes
        if mapped is not None:
            return mapped
        with _map_lock:
            if self.bytes is None:
                self.bytes = memfd.map_region(self.record)
            return self.bytes

    def unmap(self) -> None:
        self.bytes = self.dest = None


class Import:
    """An export of the peer: mapped on first use, unmapped on RELEASE or close."""

    __slots__ = ("uuid", "handle", "storage_bytes", "storage_offset", "ref_handle", "ref_offset", "bytes")

    def __init__(
        self, uuid: bytes, handle: bytes, storage_bytes: int, storage_offset: int, ref_handle: bytes, ref_offset: int
    ):
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
                "CUDA IPC needs both processes to see the same GPU; use the UCX transport"
            )
        if device is None:
            device = source
        elif device != source and not torch.cuda.can_device_access_peer(device, source):
            raise TransportError(
                f"cuda:{device} cannot access the peer's GPU {self.uuid.decode()} (cuda:{source} here): "
                f"no peer access between them; receive on cuda:{source} or use the UCX transport"
            )
        torch.cuda._lazy_init()
        # The export's own event is not waited on: the sender offers a bucket only
        # once its producers finished, and waiting on another process's event
        # could block this stream forever if that process dies.
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            self.handle,
            self.storage_bytes,
            self.storage_offset,
            self.ref_handle,
            self.ref_offset,
            bytes(IPC_EVENT_HANDLE_BYTES),
            False,
        )
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
        with torch.cuda.stream(copy_stream(mapped.device)):
            del mapped


@dataclass(slots=True)
class Offer:
    tag: int
    index: int
    seq: int
    nbytes: int
    byte_offset: int
    header: bytes
    source: Import | HostImport


@dataclass(slots=True)
class HostMessage:
    tag: int
    index: int
    nbytes: int
    header: bytes
    data: bytearray
    filled: int = 0


class Recv:
    def __init__(self, flat: torch.Tensor, header_buf: torch.Tensor, posted):
        self.flat = flat
        self.header_buf = header_buf
        self.posted = posted  # event after the caller's queued work on flat (CUDA receives)
        self.completion = threading.Event()
        self.done = False
        # Taken by the copy that received it: a shared-memory copy here, or the
        # sender's hash of the bytes it pushed into device memory.
        self.digest: int | None = None
        # Called once its buffer's export is not written into any more. The message may
        # finish the receive (on the monitor or completion thread) before the caller's
        # WANT sets it: the hand-off is under a lock of its own, so it runs exactly once.
        self._released: Callable[[], None] | None = None
        self._ended = False
        self._release_lock = threading.Lock()

    def on_released(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when this receive finishes (at once if it has)."""
        with self._release_lock:
            if not self._ended:
                self._released = callback
                return
        callback()

    def finish(self, header: bytes) -> None:
        self.header_buf.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.done = True
        self.flat = self.posted = None
        with self._release_lock:
            released, self._released, self._ended = self._released, None, True
        if released is not None:
            released()
        self.completion.set()

    def poll(self) -> bool:
        return self.done


# --- the connection ---


class IpcState(ControlledConnection):
    """What ``IpcConnection``'s halves (``Sending``, ``Receiving``) share: its state,
    set in ``IpcConnection.__init__`` (see there), and the sending methods the
    receiving half uses."""

    _transport: IpcTransport
    _host_offers: bool
    _peer_pid: int | None
    _push: bool
    _push_host: bool
    _staging: list[torch.Tensor]
    _staging_lock: threading.Lock
    staged_sends: int
    pushed_sends: int
    _push_failure: str | None
    _seq: itertools.count[int]
    _export_ids: itertools.count[int]
    _out_lock: threading.Lock
    _outbox: collections.deque[Outgoing]
    _state_lock: threading.Lock
    _sends: dict[int, Send]
    _exports: collections.OrderedDict[tuple[int, int, int], Export]
    _dest_exports: collections.OrderedDict[tuple[int, int, int], Export]
    _sent: dict[int, int]
    _received: dict[int, int]
    _waiting: dict[tuple[int, int], Recv]
    _unmatched: dict[tuple[int, int], Offer | HostMessage]
    _wants: dict[tuple[int, int], Want]
    _pushes: dict[tuple[int, int], Bucket]
    _imports: dict[int, Import | HostImport]
    _destinations: dict[int, Import | HostImport]
    _partial: HostMessage | None

    @abstractmethod
    def _offers_host(self, flat: torch.Tensor) -> bool: ...

    @abstractmethod
    def _export(
        self,
        storage: torch.UntypedStorage,
        flat: torch.Tensor,
        table: collections.OrderedDict[tuple[int, int, int], Export],
    ) -> Export: ...

    @abstractmethod
    def _retire_exports(
        self, table: collections.OrderedDict[tuple[int, int, int], Export], using: torch.UntypedStorage, *, keep: Export
    ) -> list[tuple[int, bytes]]: ...

    @abstractmethod
    def _post(self, item: Outgoing) -> None: ...

    @abstractmethod
    def _dispatch(self, item: Bucket, want: Want) -> None: ...
