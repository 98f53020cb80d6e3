"""The control socket after its handshake: frames (kind, length, payload), the
peripheral BYE, and the one thread per process that reads every connection's socket
(``ControlMonitor``): a peer's death is its socket closing."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from replica.transport.control import ControlledConnection

__all__ = ["BYE", "ControlMonitor", "GRACEFUL", "MAX_FRAME_BYTES", "SEND_TIMEOUT", "encode_frame"]


_FRAME = struct.Struct("<BI")
BYE = 0xFF  # the peer closes on purpose
MAX_FRAME_BYTES = 1 << 20
GRACEFUL = "peer closed the connection"  # it sent BYE
#: How long a control-frame send may block before the connection counts as dead.
SEND_TIMEOUT = timedelta(seconds=10)


def encode_frame(kind: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


class ControlMonitor:
    """One thread reading every control socket of a transport: it hands framed
    messages to their connection and tells it when the peer is gone.

    epoll allows registering while another thread waits, so watch/forget need no
    wake-up; close() wakes the thread through a pipe of its own, watched beside the
    sockets (a close used to wait for the next look, up to a second: the end of every
    trainer's stream).
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._stopped = threading.Event()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="replica-control-monitor", daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket, conn: ControlledConnection) -> None:
        # Timeout mode, not non-blocking: recv runs only after select said the
        # socket is readable, and a frame send may block for a bounded time.
        sock.settimeout(SEND_TIMEOUT.total_seconds())
        self._selector.register(sock, selectors.EVENT_READ, (conn, bytearray()))

    def forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):  # a full pipe has woken it already
            os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        self._selector.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _run(self) -> None:
        while not self._stopped.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:  # close() woke it
                    continue
                conn, pending = key.data
                sock = cast(socket.socket, key.fileobj)  # registered with data by watch() alone: a socket
                reason = self._read(sock, conn, pending)
                if reason is not None:
                    self.forget(sock)
                    conn._peer_lost(reason)

    @staticmethod
    def _read(sock: socket.socket, conn: ControlledConnection, pending: bytearray) -> str | None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            return None
        except OSError as exc:
            return f"control connection failed: {exc}"
        if not data:
            return "peer closed the connection or died"
        pending += data
        while len(pending) >= _FRAME.size:
            kind, length = _FRAME.unpack_from(pending)
            if kind == BYE:
                return GRACEFUL
            if length > MAX_FRAME_BYTES:
                return f"peer sent a {length}-byte control frame"
            if len(pending) < _FRAME.size + length:
                break
            payload = bytes(pending[_FRAME.size : _FRAME.size + length])
            del pending[: _FRAME.size + length]
            try:
                conn._on_control(kind, payload)
            except Exception as exc:  # noqa: BLE001 - a bad frame ends the connection, not the monitor
                return f"bad control frame {kind}: {exc}"
        return None
