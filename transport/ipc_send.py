"""The CUDA IPC connection's sending half: offers, pushes into the peer's receive
buffers, staging of host buckets, exports and the outbox (``IpcConnection`` in
``replica.transport.ipc`` holds the state both halves share, ``IpcState`` declares it)."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable

import torch

from replica import ops
from replica.errors import TransportError
from replica.transport import memfd
from replica.transport.framing import MAX_FRAME_BYTES
from replica.transport.ipc_cuda import (
    Bucket,
    Export,
    Import,
    IpcState,
    Outgoing,
    Send,
    Want,
    completes_soon,
    hash_stream,
    push_stream,
    uuid_of,
)
from replica.transport.ipc_frames import (
    CUDA_EXPORT,
    EXPORT_FIXED,
    HOST,
    HOST_EXPORT,
    HOST_FIRST_BYTES,
    HOST_FIXED,
    HOST_MORE,
    HOST_OFFER_BYTES,
    MAX_EXPORTS,
    MAX_HOST_BYTES,
    MAX_STAGED_BYTES,
    OFFER,
    OFFER_FIXED,
    PUSHED,
    PUSHED_FIXED,
    RELEASE,
    U64,
    blobs,
    digest_offset,
)

__all__ = ["Sending"]

logger = logging.getLogger(__name__)


class Sending(IpcState):
    """``IpcConnection``'s sending methods."""

    def _isend(self, flat, tag, header, ready):
        if flat.numel() == 0 or (flat.device.type == "cpu" and not self._offers_host(flat)):
            return self._send_host(flat, tag, header)
        if self._push and (flat.device.type == "cuda" or self._push_host):
            return self._send_push(flat, tag, header, ready)
        head = header()
        send = Send((flat, ready))
        with self._state_lock:
            item = Bucket(
                flat=flat, tag=tag, index=self._next_index(tag), seq=next(self._seq), head=head, ready=ready, send=send
            )
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
                "(host messages ride the control socket); send device memory, or use the UCX transport"
            )

    def _send_host(self, flat: torch.Tensor, tag: int, header: Callable[[], bytes]) -> Send:
        nbytes = flat.numel()
        head = header()
        data = flat.numpy().tobytes() if nbytes else b""
        send = Send(None)
        with self._out_lock:
            with self._state_lock:
                index = self._next_index(tag)
                seq = next(self._seq)
                self._sends[seq] = send
            frames = [(HOST, HOST_FIXED.pack(tag, index, nbytes) + head + data[:HOST_FIRST_BYTES])]
            frames += [
                (HOST_MORE, data[at : at + MAX_FRAME_BYTES]) for at in range(HOST_FIRST_BYTES, nbytes, MAX_FRAME_BYTES)
            ]
            self._post(Outgoing(ready=None, frames=frames, written=functools.partial(self._written, seq, send)))
        return send

    def _written(self, seq: int, send: Send) -> None:
        with self._state_lock:
            self._sends.pop(seq, None)
        send.finish()

    def _send_push(self, flat: torch.Tensor, tag: int, header: Callable[[], bytes], ready) -> Send:
        """A bucket for the receive the peer posts (or posted) under the same tag and
        index: pushed into its buffer if that can be mapped here, else offered."""
        head = header()  # here, in the caller's thread (it may hash the bucket; see Connection.isend)
        send = Send((flat, ready))
        with self._state_lock:
            if self._error is not None:
                raise self._error
            index = self._sent[tag]
            self._sent[tag] = index + 1
            item = Bucket(flat=flat, tag=tag, index=index, seq=next(self._seq), head=head, ready=ready, send=send)
            self._sends[item.seq] = send
            want = self._wants.pop((tag, index), None)
            if want is None:
                self._pushes[(tag, index)] = item
        if want is not None:
            self._transport._pusher.submit(None, functools.partial(self._dispatch, item, want))
        return send

    def _dispatch(self, item: Bucket, want: Want) -> None:
        """Pusher thread: copy ``item`` into the peer's receive buffer, or offer it
        when that buffer cannot be mapped here (or a push failed on this connection)."""
        if self._error is not None:
            return  # its waiter was woken with the connection's error
        source, flat = want.source, item.flat
        if (
            source is None
            or self._push_failure is not None
            or (isinstance(source, Import) and flat.device.type != "cuda")
        ):
            self._offer(item)
            return
        n = min(flat.numel(), want.nbytes)  # a size mismatch fails the receive's check
        offset = digest_offset(item.head) if self._verify_digests else None
        digest = None
        try:
            if isinstance(source, Import):
                full = source.map(None)
            else:
                full = source.destination(pin=flat.device.type == "cuda")
            dst, src = full[want.byte_offset : want.byte_offset + n], flat[:n]
            if flat.device.type == "cuda":
                stream = push_stream(flat.device)
                if item.ready is not None:
                    stream.wait_event(item.ready)  # its producers alone, never a thread's current stream
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                copied = torch.cuda.Event(blocking=True)
                copied.record(stream)
                if dst.device.type == "cuda" and offset is not None and n:
                    # The bytes where they landed, hashed here: the receiver's process
                    # does no GPU work (see the module docstring).
                    hashing = hash_stream(flat.device)
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
            logger.warning(
                "cannot copy into the buffers of %s (%s); offering it its buckets to copy instead", self.peer, exc
            )
            self._offer(item)
            return
        with self._state_lock:
            self.pushed_sends += 1
        # The bucket, the mapping and the digest stay referenced until the copy has run.
        self._transport._copied.submit(copied, functools.partial(self._pushed, item, digest, (src, dst, full)))

    def _pushed(self, item: Bucket, digest: torch.Tensor | None, keep) -> None:
        """Completion thread: ``item``'s copy into the peer's buffer has run; tell the peer."""
        taken = digest is not None
        frame = PUSHED_FIXED.pack(item.tag, item.index, taken, int(digest[0]) if taken else 0) + item.head
        try:
            self._send_control(PUSHED, frame)
        except TransportError:
            return  # the peer is gone; the send's waiter sees the connection's error
        self._written(item.seq, item.send)

    def _offer(self, item: Bucket) -> None:
        """Offer a bucket (a device bucket, or a host bucket as shared memory) for the peer to copy."""
        flat, finished = item.flat, None
        if flat.device.type == "cpu" and memfd.region_of(flat) is None:
            flat, finished = self._stage(flat)
            item.send._finished = finished
        storage = flat.untyped_storage()
        with self._out_lock:
            export = self._export(storage, flat, self._exports)
            item.send._keep = (flat, item.ready)
            item.send.export = export
            with self._state_lock:
                export.inflight += 1  # first: an export in flight is never retired
            frames = self._retire_exports(self._exports, storage, keep=export)
            fixed = OFFER_FIXED.pack(
                item.tag, item.index, item.seq, export.id, flat.storage_offset(), flat.numel(), not export.announced
            )
            frames.append((OFFER, fixed + item.head + (b"" if export.announced else export.record)))
            export.announced = True
            self._post(Outgoing(ready=item.ready, frames=frames))

    def _stage(self, flat: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A copy of ``flat`` in a staging region (reused from the pool when one is
        large enough), and what gives the region back once the send is acknowledged."""
        n = flat.numel()
        with self._staging_lock:
            fits = [i for i, r in enumerate(self._staging) if r.numel() >= n]  # by index: tensors compare by value
            region = self._staging.pop(min(fits, key=lambda i: self._staging[i].numel())) if fits else None
            self.staged_sends += 1
        if region is None:
            region = memfd.shared_empty(max(n, HOST_OFFER_BYTES))
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

    def _export(
        self,
        storage: torch.UntypedStorage,
        flat: torch.Tensor,
        table: collections.OrderedDict[tuple[int, int, int], Export],
    ) -> Export:
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
            region = memfd.region_of(flat)
            if region is None or region.offset != flat.storage_offset():
                raise TransportError("a host bucket offered that is not in a shared-memory region of its own")
            record = HOST_EXPORT + region.record
        else:
            try:
                (_, handle, storage_bytes, storage_offset, ref_handle, ref_offset, _event, _sync) = (
                    storage._share_cuda_()
                )
            except RuntimeError as exc:
                raise TransportError(f"cannot export this CUDA buffer for IPC ({exc}); use the UCX transport") from exc
            record = (
                CUDA_EXPORT
                + EXPORT_FIXED.pack(storage_bytes, storage_offset, ref_offset)
                + blobs(uuid_of(flat.device.index), handle, ref_handle)
            )
        export = Export(next(self._export_ids), StorageWeakRef(storage), record)
        with self._state_lock:
            table[key] = export
        return export

    def _retire_exports(
        self, table: collections.OrderedDict[tuple[int, int, int], Export], using: torch.UntypedStorage, *, keep: Export
    ) -> list[tuple[int, bytes]]:
        """RELEASE frames for the exports of ``table`` whose storage is gone, those of
        the storage in use that it has left (a resize moved its bytes), and, past
        MAX_EXPORTS, the least recently used ones; never one in use (a send or a
        receive in flight), nor ``keep``, the export the frame being built names. Caller
        holds _out_lock."""
        frames = []
        moved = using._cdata
        with self._state_lock:
            over = len(table) - MAX_EXPORTS
            for key, export in list(table.items()):
                if export.inflight or export is keep:
                    continue
                if over > 0 or key[0] == moved or export.ref.expired():
                    del table[key]
                    over -= 1
                    if export.announced:
                        frames.append((RELEASE, U64.pack(export.id)))
        return frames

    def _post(self, item: Outgoing) -> None:
        """Write the item now if nothing is queued before it and its bucket is
        ready, else queue it for the ready thread. Caller holds _out_lock."""
        if not self._outbox and (item.ready is None or completes_soon(item.ready)):
            self._write(item)
        else:
            self._outbox.append(item)
            self._transport._ready.submit(item.ready, self._flush)

    def _flush(self) -> None:
        """Ready thread: write the queued items whose buckets are ready, in order."""
        with self._out_lock:
            while self._outbox and (self._outbox[0].ready is None or self._outbox[0].ready.query()):
                self._write(self._outbox.popleft())

    def _write(self, item: Outgoing) -> None:
        try:
            for kind, payload in item.frames:
                self._send_control(kind, payload)
        except TransportError:
            return  # the connection failed; its waiters were woken
        if item.written is not None:
            item.written()
