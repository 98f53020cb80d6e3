"""CUDA IPC backend: same node, device memory only. The sender exports the
CUDA allocation behind a bucket (torch's own IPC handles) and an interprocess
event recorded after the bucket's producer work; the receiver maps the
allocation once (cached), waits on the event on its current stream, copies
device to device into the caller's buffer, and acknowledges when the copy has
run, which completes the send. Nothing but small frames crosses the control
socket; no bytes of the bucket leave the GPU."""

from __future__ import annotations

import collections
import itertools
import struct
import threading
from dataclasses import dataclass

import torch

from replica.errors import TransportError
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import ControlledConnection, ControlledTransport, EndpointConfig
from replica.transport.wire import HEADER_BYTES

__all__ = ["IpcConfig", "IpcConnection", "IpcTransport"]

_OFFER = 1
_ACK = 2
# tag, seq, device, storage bytes, storage offset, byte offset of the bucket in
# the storage, ref-counter offset, event-sync flag; then the 64-byte header and
# four length-prefixed blobs: storage handle, ref-counter handle, torch's
# event handle, and replica's own ready-event handle.
_OFFER_FIXED = struct.Struct("<QQiQQQQB")
_ACK_FRAME = struct.Struct("<QQ")
_BLOB = struct.Struct("<I")
#: Mapped allocations kept per connection; the mirror reuses a few snapshot buffers.
MAPPED_CACHE_ENTRIES = 64


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class IpcConfig(EndpointConfig):
    pass


@dataclass(kw_only=True, frozen=True, slots=True)
class _Offer:
    tag: int
    seq: int
    device: int
    storage_bytes: int
    storage_offset: int
    byte_offset: int
    ref_counter_offset: int
    event_sync_required: bool
    header: bytes
    handle: bytes
    ref_counter_handle: bytes
    event_handle: bytes
    ready_event: bytes

    def encode(self) -> bytes:
        fixed = _OFFER_FIXED.pack(self.tag, self.seq, self.device, self.storage_bytes, self.storage_offset,
                                  self.byte_offset, self.ref_counter_offset, int(self.event_sync_required))
        blobs = b"".join(_BLOB.pack(len(b)) + b for b in
                         (self.handle, self.ref_counter_handle, self.event_handle, self.ready_event))
        return fixed + self.header + blobs

    @classmethod
    def decode(cls, data: bytes) -> _Offer:
        fields = _OFFER_FIXED.unpack_from(data)
        at = _OFFER_FIXED.size
        header = data[at:at + HEADER_BYTES]
        at += HEADER_BYTES
        blobs = []
        for _ in range(4):
            (n,) = _BLOB.unpack_from(data, at)
            at += _BLOB.size
            blobs.append(data[at:at + n])
            at += n
        tag, seq, device, size, offset, byte_offset, ref_offset, sync = fields
        return cls(tag=tag, seq=seq, device=device, storage_bytes=size, storage_offset=offset,
                   byte_offset=byte_offset, ref_counter_offset=ref_offset, event_sync_required=bool(sync),
                   header=header, handle=blobs[0], ref_counter_handle=blobs[1], event_handle=blobs[2],
                   ready_event=blobs[3])


class _Send:
    def __init__(self, keep):
        self.acked = threading.Event()
        self._keep = keep  # the bucket and its event stay alive until the receiver copied

    def poll(self) -> bool:
        if not self.acked.is_set():
            return False
        self._keep = None
        return True


class _Recv:
    def __init__(self, conn: IpcConnection, flat: torch.Tensor, tag: int, header_buf: torch.Tensor):
        self._conn = conn
        self._flat = flat
        self._tag = tag
        self._header_buf = header_buf
        self.offer: _Offer | None = None  # set under the connection's lock when matched
        self._copied: torch.cuda.Event | None = None

    def poll(self) -> bool:
        if self._copied is None:
            offer = self.offer
            if offer is None:
                return False
            self._header_buf.copy_(torch.frombuffer(bytearray(offer.header), dtype=torch.uint8))
            self._copied = self._conn._copy_in(offer, self._flat)
        if not self._copied.query():
            return False
        self._conn._send_control(_ACK, _ACK_FRAME.pack(self.offer.tag, self.offer.seq))
        return True


class IpcConnection(ControlledConnection):
    def __init__(self, **kwargs):
        super().__init__(memory=MemoryKind.CUDA, **kwargs)
        self._seq = itertools.count()
        self._match_lock = threading.Lock()
        self._sends: dict[int, _Send] = {}
        self._waiting: dict[int, collections.deque[_Recv]] = collections.defaultdict(collections.deque)
        self._unmatched: dict[int, collections.deque[_Offer]] = collections.defaultdict(collections.deque)
        self._mapped: collections.OrderedDict[tuple[bytes, int], torch.UntypedStorage] = collections.OrderedDict()

    def _isend(self, flat, tag, header):
        storage = flat.untyped_storage()
        device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = storage._share_cuda_()
        ready = torch.cuda.Event(interprocess=True)
        ready.record()
        header_bytes = header()
        seq = next(self._seq)
        pending = _Send((flat, storage, ready))
        with self._match_lock:
            self._sends[seq] = pending
        offer = _Offer(tag=tag, seq=seq, device=device, storage_bytes=size, storage_offset=offset,
                       byte_offset=flat.storage_offset() * flat.element_size(), ref_counter_offset=ref_offset,
                       event_sync_required=bool(sync), header=header_bytes, handle=handle,
                       ref_counter_handle=ref_handle, event_handle=event_handle or b"",
                       ready_event=ready.ipc_handle())
        self._send_control(_OFFER, offer.encode())
        return pending

    def _irecv(self, flat, tag, header_buf):
        receive = _Recv(self, flat, tag, header_buf)
        with self._match_lock:
            if self._unmatched[tag]:
                receive.offer = self._unmatched[tag].popleft()
            else:
                self._waiting[tag].append(receive)
        return receive

    def _on_control(self, kind, payload):
        if kind == _ACK:
            _, seq = _ACK_FRAME.unpack(payload)
            with self._match_lock:
                pending = self._sends.pop(seq, None)
            if pending is None:
                raise TransportError(f"acknowledgement of unknown send {seq}")
            pending.acked.set()
        elif kind == _OFFER:
            offer = _Offer.decode(payload)
            with self._match_lock:
                if self._waiting[offer.tag]:
                    self._waiting[offer.tag].popleft().offer = offer
                else:
                    self._unmatched[offer.tag].append(offer)
        else:
            super()._on_control(kind, payload)

    def _copy_in(self, offer: _Offer, flat: torch.Tensor) -> torch.cuda.Event:
        nbytes = min(flat.numel(), offer.storage_bytes - offer.byte_offset)
        storage = self._map(offer)
        src = torch.empty(0, dtype=torch.uint8, device=flat.device).set_(storage, offer.byte_offset, (nbytes,))
        stream = torch.cuda.current_stream(flat.device)
        stream.wait_event(torch.cuda.Event.from_ipc_handle(flat.device, offer.ready_event))
        flat[:nbytes].copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def _map(self, offer: _Offer) -> torch.UntypedStorage:
        key = (offer.handle, offer.storage_offset)
        storage = self._mapped.get(key)
        if storage is not None:
            # Already mapped: hand the producer's new reference back at once (as torch does).
            torch.UntypedStorage._release_ipc_counter(offer.ref_counter_handle, offer.ref_counter_offset,
                                                      device=offer.device)
            self._mapped.move_to_end(key)
            return storage
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            offer.device, offer.handle, offer.storage_bytes, offer.storage_offset, offer.ref_counter_handle,
            offer.ref_counter_offset, offer.event_handle or None, offer.event_sync_required)
        self._mapped[key] = storage
        while len(self._mapped) > MAPPED_CACHE_ENTRIES:
            self._mapped.popitem(last=False)
        return storage

    def _release(self) -> None:
        with self._match_lock:
            self._mapped.clear()
            self._sends.clear()
            self._waiting.clear()
            self._unmatched.clear()


class IpcTransport(ControlledTransport):
    """CUDA IPC between processes of one node."""

    capabilities = Capabilities(memory=MemoryKind.CUDA, locality=Locality.SAME_NODE)

    def __init__(self, config: IpcConfig):
        super().__init__(config)
        self.config = config

    def _offer(self, server):
        return b"", None

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        return IpcConnection(transport=self, sock=sock, peer=peer, verify=self.config.verify)

    def _shutdown(self) -> None:
        pass
