"""One etcd watch over the v3 HTTP/JSON gateway, read under deadlines.

``EtcdStore.wait`` blocks on one of these instead of polling: the gateway answers a
``POST /v3/watch`` with a chunked response of newline-delimited JSON messages (the
``created`` answer, then one per batch of events) that stays open until the client
closes it. ``http.client`` cannot read such a response with a deadline and go on
afterwards (a read that times out leaves its buffered reader undefined), so this
module speaks the few lines of HTTP/1.1 it needs over a socket of its own and keeps
its own buffer: a read that runs out of time loses nothing, and the next read of the
same stream goes on where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from datetime import timedelta

from replica.timing import Deadline

__all__ = ["WatchBroken", "WatchStream"]

_READ_CHUNK = 65536
_MAX_BUFFERED = 16 << 20  # a stream that sends this much without a full message is broken


class WatchBroken(Exception):
    """The watch cannot go on: the connection closed or failed, the gateway refused it,
    or it sent something that is not a watch response (read the keys and open another)."""


class WatchStream:
    """``POST path`` with ``body`` to ``endpoint`` and read the streamed messages (``next``).

    Raises ``WatchBroken`` when the connection or the request fails within ``timeout``."""

    def __init__(
        self,
        endpoint: tuple[str, int],
        path: str,
        body: dict,
        *,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext | None,
        timeout: timedelta,
    ):
        self.endpoint = endpoint
        self._buffer = bytearray()  # received bytes not yet parsed (inside or between chunks)
        self._lines = bytearray()  # the chunks' payload not yet split into messages
        self._chunk_left = 0  # payload bytes of the current chunk still to come (+2 for its CRLF)
        deadline = Deadline.after(timeout)
        host, port = endpoint
        payload = json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}:{port}",
            f"Content-Length: {len(payload)}",
            "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in headers.items()),
            "",
            "",
        ]
        try:
            sock = socket.create_connection(endpoint, timeout=timeout.total_seconds())
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            raise WatchBroken(f"{host}:{port}: {exc!r}") from None
        self._sock = sock
        try:
            sock.sendall("\r\n".join(head).encode() + payload)
            status, chunked = self._read_head(deadline)
        except (OSError, WatchBroken) as exc:
            self.close()
            raise WatchBroken(f"{host}:{port}: {exc}") from None
        if status != 200 or not chunked:
            self.close()
            raise WatchBroken(f"{host}:{port}: the watch was refused (HTTP {status})")

    def next(self, deadline: Deadline) -> dict | None:
        """The next message, or None when ``deadline`` passed first
        (the stream stays usable). WatchBroken when the stream ended or failed."""
        while True:
            line_end = self._lines.find(b"\n")
            if line_end >= 0:
                line = bytes(self._lines[:line_end])
                del self._lines[: line_end + 1]
                if not line.strip():
                    continue
                try:
                    message = json.loads(line)
                except ValueError:
                    raise WatchBroken(f"not a watch message: {line[:80]!r}") from None
                if not isinstance(message, dict):
                    raise WatchBroken(f"not a watch message: {line[:80]!r}")
                return message
            if self._unchunk():
                continue
            if not self._receive(deadline):
                return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _read_head(self, deadline: Deadline) -> tuple[int, bool]:
        """The response's status and whether its body is chunked; the buffer keeps what follows."""
        while b"\r\n\r\n" not in self._buffer:
            if len(self._buffer) > _READ_CHUNK or not self._receive(deadline):
                raise WatchBroken("no response head in time")
        head, _, rest = bytes(self._buffer).partition(b"\r\n\r\n")
        self._buffer[:] = rest
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise WatchBroken(f"not an HTTP response: {lines[0][:80]!r}")
        chunked = any(line.lower().replace(" ", "") == "transfer-encoding:chunked" for line in lines[1:])
        return int(parts[1]), chunked

    def _unchunk(self) -> bool:
        """Move the buffered chunks' payload into ``_lines``; True when any moved."""
        moved = False
        while self._buffer:
            if self._chunk_left == 0:
                size_end = self._buffer.find(b"\r\n")
                if size_end < 0:
                    break
                try:
                    size = int(bytes(self._buffer[:size_end]).split(b";")[0], 16)
                except ValueError:
                    raise WatchBroken(f"a bad chunk size: {bytes(self._buffer[:size_end])[:40]!r}") from None
                if size == 0:
                    raise WatchBroken("the watch stream ended")
                del self._buffer[: size_end + 2]
                self._chunk_left = size + 2
            take = min(self._chunk_left, len(self._buffer))
            payload = min(take, max(0, self._chunk_left - 2))  # the chunk's CRLF is not payload
            self._lines += self._buffer[:payload]
            del self._buffer[:take]
            self._chunk_left -= take
            moved = moved or payload > 0
        if len(self._lines) > _MAX_BUFFERED:
            raise WatchBroken("a watch message too large")
        return moved

    def _receive(self, deadline: Deadline) -> bool:
        """Receive what the socket has, waiting until ``deadline``; False when it passed."""
        left = deadline.remaining_s()
        if left <= 0:
            return False
        try:
            self._sock.settimeout(left)
            data = self._sock.recv(_READ_CHUNK)
        except TimeoutError:
            return False
        except OSError as exc:
            raise WatchBroken(repr(exc)) from None
        if not data:
            raise WatchBroken("the connection closed")
        self._buffer += data
        return True
