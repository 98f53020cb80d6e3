"""The CUDA IPC connection's receiving half: the control frames' dispatch, WANTs for
receive buffers, imports of the peer's exports, matching and copies."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from replica import ops
from replica.errors import TransportError
from replica.transport import memfd
from replica.transport.ipc_cuda import (
    Export,
    HostImport,
    HostMessage,
    Import,
    IpcState,
    Offer,
    Outgoing,
    Recv,
    Want,
    copy_stream,
)
from replica.transport.ipc_frames import (
    ACK,
    CUDA_EXPORT,
    EXPLAIN,
    EXPORT_FIXED,
    HOST,
    HOST_EXPORT,
    HOST_FIXED,
    HOST_MORE,
    INLINE_COPY_BYTES,
    MAX_HOST_BYTES,
    MAX_IMPORTS,
    OFFER,
    OFFER_FIXED,
    PUSHED,
    PUSHED_FIXED,
    RELEASE,
    U64,
    WANT,
    WANT_FIXED,
    digest_offset,
    read_blobs,
)
from replica.transport.wire import HEADER_BYTES

__all__ = ["Receiving"]

logger = logging.getLogger(__name__)


class Receiving(IpcState):
    """``IpcConnection``'s receiving methods."""

    def _irecv(self, flat, tag, header_buf, ready):
        receive = Recv(flat, header_buf, ready)
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
        return self._offers_host(flat) and memfd.region_of(flat) is not None

    def _want(self, receive: Recv, flat: torch.Tensor, tag: int, index: int, ready) -> None:
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
                    receive.on_released(functools.partial(self._release_destination, export))
                    # Never the export this WANT names: its receive may have finished already
                    # (the message came first), leaving it with nothing in flight.
                    frames = self._retire_exports(self._dest_exports, storage, keep=export)
            if export is None:
                frames.append((WANT, WANT_FIXED.pack(tag, index, 0, 0, flat.numel(), False)))
            else:
                announce = not export.announced
                fixed = WANT_FIXED.pack(tag, index, export.id, flat.storage_offset(), flat.numel(), announce)
                frames.append((WANT, fixed + (export.record if announce else b"")))
                export.announced = True
            # The peer writes into the buffer once it has the WANT: not before the work
            # queued on it has run (a host wait on the ready thread; never an event of
            # another process, whose death could leave this one's stream blocked).
            self._post(Outgoing(ready=ready if export is not None else None, frames=frames))

    def _release_destination(self, export: Export) -> None:
        with self._state_lock:
            export.inflight -= 1

    def _on_control(self, kind, payload):
        if kind == ACK:
            (seq,) = U64.unpack(payload)
            with self._state_lock:
                send = self._sends.pop(seq, None)
                if send is not None and send.export is not None:
                    send.export.inflight -= 1
            if send is None:
                raise TransportError(f"acknowledgement of unknown send {seq}")
            send.finish()
        elif kind == OFFER:
            self._match(self._decode_offer(payload))
        elif kind == WANT:
            self._on_want(payload)
        elif kind == PUSHED:
            tag, index, taken, digest = PUSHED_FIXED.unpack_from(payload)
            header = payload[PUSHED_FIXED.size : PUSHED_FIXED.size + HEADER_BYTES]
            with self._state_lock:
                receive = self._waiting.pop((tag, index), None)
            if receive is None:
                raise TransportError(f"a push of tag {tag} message {index} into no posted receive")
            if taken:
                receive.digest = digest
            receive.finish(header)
        elif kind == HOST:
            tag, index, nbytes = HOST_FIXED.unpack_from(payload)
            if self._partial is not None:
                raise TransportError("a host message began inside another")
            if nbytes > MAX_HOST_BYTES:
                raise TransportError(f"peer announced a {nbytes}-byte host message")
            at = HOST_FIXED.size + HEADER_BYTES
            self._partial = HostMessage(
                tag=tag, index=index, nbytes=nbytes, header=payload[HOST_FIXED.size : at], data=bytearray(nbytes)
            )
            self._host_bytes(self._partial, payload, at)
        elif kind == HOST_MORE:
            if self._partial is None:
                raise TransportError("host message bytes without a host message")
            self._host_bytes(self._partial, payload, 0)
        elif kind == RELEASE:
            (export_id,) = U64.unpack(payload)
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
        tag, index, export_id, byte_offset, nbytes, announces = WANT_FIXED.unpack_from(payload)
        source = None
        if export_id:
            with self._state_lock:
                source = self._destinations.get(export_id)
            if announces:
                if source is not None:
                    raise TransportError(f"export {export_id} announced twice")
                source = self._decode_export(payload, WANT_FIXED.size, mapped=False)
                with self._state_lock:
                    if len(self._destinations) >= MAX_IMPORTS:
                        raise TransportError(
                            f"peer exported more than {MAX_IMPORTS} receive buffers without releasing any"
                        )
                    self._destinations[export_id] = source
            elif source is None:
                raise TransportError(f"a receive into unknown export {export_id}")
            if byte_offset + nbytes > source.storage_bytes:
                raise TransportError(
                    f"a receive into bytes [{byte_offset}, {byte_offset + nbytes}) of a "
                    f"{source.storage_bytes}-byte storage"
                )
        want = Want(tag=tag, index=index, source=source, byte_offset=byte_offset, nbytes=nbytes)
        with self._state_lock:
            item = self._pushes.pop((tag, index), None)
            if item is None:
                if index >= self._sent[tag]:  # else its send went without waiting for it
                    self._wants[(tag, index)] = want
                return
        # Mapping and copying are the pusher thread's: this one reads the peer's frames (and its death).
        self._transport._pusher.submit(None, functools.partial(self._dispatch, item, want))

    def _host_bytes(self, message: HostMessage, payload: bytes, at: int) -> None:
        """``payload[at:]``: the next bytes of ``message``, the host message being received."""
        n = len(payload) - at
        if message.filled + n > message.nbytes:
            raise TransportError("a host message ran past its announced size")
        message.data[message.filled : message.filled + n] = memoryview(payload)[at:]
        message.filled += n
        if message.filled == message.nbytes:
            self._partial = None
            self._match(message)

    def _decode_export(self, payload: bytes, at: int, *, mapped: bool) -> Import | HostImport:
        """An export record at ``payload[at:]``. ``mapped``: a region the peer offers is
        mapped at once (it can be opened only while its owner lives, and once mapped it
        outlives its owner); the peer's receive buffers are mapped on the first push."""
        kind, at = payload[at : at + 1], at + 1
        if kind == HOST_EXPORT:
            if not self._host_offers:
                raise TransportError("a shared-memory export on a connection that takes none")
            source = HostImport(payload[at:])
            if source.pid != self._peer_pid:
                raise TransportError("a shared-memory export of a region another process made")
            if mapped:  # the copy says why if this failed
                with contextlib.suppress(TransportError):
                    source.map(None)
            return source
        if kind == CUDA_EXPORT:
            storage_bytes, storage_offset, ref_offset = EXPORT_FIXED.unpack_from(payload, at)
            (uuid, handle, ref_handle), _ = read_blobs(payload, at + EXPORT_FIXED.size, 3)
            return Import(uuid, handle, storage_bytes, storage_offset, ref_handle, ref_offset)
        raise TransportError(f"an export of unknown kind {kind!r}")

    def _decode_offer(self, payload: bytes) -> Offer:
        tag, index, seq, export_id, byte_offset, nbytes, announces = OFFER_FIXED.unpack_from(payload)
        at = OFFER_FIXED.size + HEADER_BYTES
        header = payload[OFFER_FIXED.size : at]
        with self._state_lock:
            source = self._imports.get(export_id)
        if announces:
            if source is not None:
                raise TransportError(f"export {export_id} announced twice")
            source = self._decode_export(payload, at, mapped=True)
            with self._state_lock:
                if len(self._imports) >= MAX_IMPORTS:
                    raise TransportError(f"peer exported more than {MAX_IMPORTS} storages without releasing any")
                self._imports[export_id] = source
        elif source is None:
            raise TransportError(f"offer of unknown export {export_id}")
        if byte_offset + nbytes > source.storage_bytes:
            raise TransportError(
                f"offer of bytes [{byte_offset}, {byte_offset + nbytes}) of a {source.storage_bytes}-byte storage"
            )
        return Offer(
            tag=tag, index=index, seq=seq, nbytes=nbytes, byte_offset=byte_offset, header=header, source=source
        )

    def _match(self, message: Offer | HostMessage) -> None:
        key = (message.tag, message.index)
        with self._state_lock:
            receive = self._waiting.pop(key, None)
            if receive is None:
                if key in self._unmatched:
                    raise TransportError(f"tag {message.tag} message {message.index} arrived twice")
                self._unmatched[key] = message
        if receive is not None:
            self._deliver(receive, message)

    def _deliver(self, receive: Recv, message: Offer | HostMessage) -> None:
        """Copy a matched message into its receive buffer: at once for host
        bytes into host memory, else on the copy stream, finished by the
        completion thread (which also acknowledges offers)."""
        flat = receive.flat
        assert flat is not None, "a receive is delivered once, and finishes only then"
        n = min(flat.numel(), message.nbytes)  # a size mismatch fails the receive's check
        try:
            if isinstance(message, HostMessage):
                if n == 0 or flat.device.type == "cpu":
                    if n:
                        flat[:n].copy_(torch.frombuffer(message.data, dtype=torch.uint8, count=n))
                    receive.finish(message.header)
                    return
                src = torch.frombuffer(message.data, dtype=torch.uint8, count=n)
            elif isinstance(message.source, HostImport) and flat.device.type == "cpu":
                if n <= INLINE_COPY_BYTES and message.source.bytes is not None:
                    self._copy_shared(receive, message, n, inline=True)
                else:  # off the monitor thread, which reads the peer's frames (and its death)
                    self._transport._copied.submit(None, functools.partial(self._copy_shared, receive, message, n))
                return
            else:
                mapped = message.source.map(flat.device.index if flat.device.type == "cuda" else None)
                src = mapped[message.byte_offset : message.byte_offset + n]
            device = flat.device if flat.device.type == "cuda" else src.device
            stream = copy_stream(device)
            if receive.posted is not None:
                stream.wait_event(receive.posted)
            with torch.cuda.stream(stream):
                flat[:n].copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        except Exception as exc:  # noqa: BLE001 - a failed copy fails the connection, not the thread
            receive.completion.set()
            self._fail(
                exc
                if isinstance(exc, TransportError)
                else TransportError(f"receiving tag {message.tag} from {self.peer} failed: {exc}")
            )
            return
        # src (the mapping) and flat stay referenced until the copy has run.
        self._transport._copied.submit(copied, functools.partial(self._copied, receive, message, src, flat))

    def _copy_shared(self, receive: Recv, message: Offer, n: int, *, inline: bool = False) -> None:
        """Copy a shared-memory bucket out of the peer's region, hashing it in the same
        pass when digests are on, then acknowledge it. On the completion thread, or
        ``inline`` in the thread that matched it (a small bucket of a region mapped already)."""
        flat = receive.flat
        if flat is None or self._error is not None:
            return  # the connection failed: its waiters were woken, the buffer is theirs again
        try:
            src = message.source.map(None)[message.byte_offset : message.byte_offset + n]
            offset = digest_offset(message.header) if self._verify_digests else None
            if offset is None:
                flat[:n].copy_(src)
            else:
                receive.digest = int(ops.pack_checksum([src], flat[:n], [0], -(-n // 8) * 8, offset // 8)[0])
        except Exception as exc:  # noqa: BLE001 - a failed copy fails the connection, not the thread
            # A region that cannot be opened any more most often means its owner died:
            # the control socket says so within moments, and then that is the error.
            if inline or not self._failed.wait(EXPLAIN.total_seconds()):
                self._fail(
                    exc
                    if isinstance(exc, TransportError)
                    else TransportError(f"receiving tag {message.tag} from {self.peer} failed: {exc}")
                )
            receive.completion.set()
            return
        del src
        self._copied(receive, message, None, None)

    def _copied(self, receive: Recv, message: Offer | HostMessage, src, flat) -> None:
        # src and flat are only held: their last references drop after this returns.
        receive.finish(message.header)
        if isinstance(message, Offer):
            with contextlib.suppress(TransportError):  # the peer is gone; it no longer waits for the acknowledgement
                self._send_control(ACK, U64.pack(message.seq))
