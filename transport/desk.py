"""A desk: named byte blobs served to the job's own processes over TCP.

The rollout data path (``replica.roles.rollouts``): an engine keeps the prompts of the
requests it may serve and the completions it made on its desk, and the trainers fetch them
there, so no value in the job store grows with a step's prompts or tokens. A desk binds
loopback unless told otherwise, and every connection first proves it holds the job's token
(the control socket's handshake, ``replica.transport.handshake``). What a blob holds is
vouched for elsewhere: the signed store record that names a blob carries its digest, and
readers check it (``blob_digest``).

After the handshake a connection carries requests, one at a time: ``op`` (u8), the name's
length (u16), the payload's length (u64), the name (UTF-8), the payload; each answered by a
status (u8), a length (u64) and a payload (the blob, or a refusal's reason)."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import socket
import struct
import threading
from collections.abc import Callable
from datetime import timedelta

from replica.errors import AuthenticationError, PeerDisconnectedError, TransferTimeoutError, TransportError
from replica.transport.handshake import (
    ControlServer,
    HandshakeDeadline,
    client_handshake,
    parse_address,
    recv_exact,
    send_all,
    server_handshake,
)

__all__ = ["Desk", "DeskClient", "MAX_BLOB_BYTES", "MAX_CONNECTIONS", "blob_digest"]

logger = logging.getLogger(__name__)

#: The largest blob a desk takes or serves (a step's completions are tens to hundreds of MB).
MAX_BLOB_BYTES = 1 << 32
#: Connections a desk serves at once; more wait in the listen queue.
MAX_CONNECTIONS = 64
_REQUEST = struct.Struct("<BHQ")
_ANSWER = struct.Struct("<BQ")
_MAX_NAME_BYTES = 1024


class _Op(enum.IntEnum):
    GET = 1
    PUT = 2


class _Status(enum.IntEnum):
    OK = 0
    MISSING = 1
    REFUSED = 2


def blob_digest(blob: bytes | memoryview) -> str:
    """The digest a store record names a blob by (SHA-256, hex)."""
    return hashlib.sha256(blob).hexdigest()


class Desk:
    """A desk's server and its blobs. ``put``/``get``/``drop`` act on the blobs here; peers
    holding ``token`` reach them at ``address`` (``DeskClient``). ``on_put(name)`` runs once a
    peer's PUT is stored, before the peer hears so. ``timeout``: how long a peer may take over a handshake or a
    request before its connection is dropped."""

    def __init__(
        self,
        *,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: timedelta = timedelta(seconds=30),
        on_put: Callable[[str], None] | None = None,
    ):
        if not token:
            raise ValueError("a desk needs the job's token")
        self._token = token
        self._timeout = timeout
        self._on_put = on_put
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server = ControlServer(host, port)
        self.address = self._server.address
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="replica-desk", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # never the token
        return f"Desk({self.address}, {len(self._blobs)} blobs)"

    def put(self, name: str, blob: bytes) -> None:
        _check_name(name)
        with self._lock:
            self._blobs[name] = bytes(blob)

    def get(self, name: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._blobs)

    def drop(self, keep: Callable[[str], bool]) -> int:
        """Forget every blob whose name ``keep`` refuses; returns how many went."""
        with self._lock:
            gone = [name for name in self._blobs if not keep(name)]
            for name in gone:
                del self._blobs[name]
        return len(gone)

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> Desk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept(timeout_s=1.0)
            except TransferTimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(timeout=self._timeout.total_seconds()):
                sock.close()
                continue
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer), name="replica-desk-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            server_handshake(
                sock, peer=peer, token=self._token, address=b"", inbound_id=0, timeout_s=self._timeout.total_seconds()
            )
            while not self._closed.is_set() and self._answer(sock, peer):
                pass
        except AuthenticationError as exc:
            logger.warning("desk %s: %s", self.address, exc)
        except (TransportError, OSError) as exc:
            logger.debug("desk %s: %s left: %s", self.address, peer, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
            self._slots.release()

    def _answer(self, sock: socket.socket, peer: str) -> bool:
        """Serve one request; False when the peer closed between requests."""
        sock.settimeout(None)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except OSError:
            return False
        if not first:
            return False
        deadline = HandshakeDeadline(self._timeout.total_seconds(), f"a request of {peer}")
        op, name_len, size = _REQUEST.unpack(recv_exact(sock, _REQUEST.size, deadline))
        if name_len > _MAX_NAME_BYTES or size > MAX_BLOB_BYTES or op not in (_Op.GET, _Op.PUT):
            _reply(sock, _Status.REFUSED, f"bad request (op {op}, name {name_len} B, {size} B)".encode(), deadline)
            return False
        name = recv_exact(sock, name_len, deadline).decode("utf-8", "replace")
        if op == _Op.PUT:
            self.put(name, recv_exact(sock, size, deadline))
            if self._on_put is not None:
                self._on_put(name)
            _reply(sock, _Status.OK, b"", deadline)
            return True
        blob = self.get(name)
        _reply(sock, _Status.MISSING if blob is None else _Status.OK, blob or b"", deadline)
        return True


def _reply(sock: socket.socket, status: _Status, payload: bytes, deadline: HandshakeDeadline) -> None:
    send_all(sock, _ANSWER.pack(status, len(payload)), deadline)
    if payload:
        send_all(sock, payload, deadline)


def _check_name(name: str) -> bytes:
    raw = name.encode()
    if not raw or len(raw) > _MAX_NAME_BYTES:
        raise ValueError(f"a blob's name must be 1-{_MAX_NAME_BYTES} bytes, got {len(raw)}")
    return raw


class DeskClient:
    """One connection to a peer's desk (made at the first request, made again after a
    failure). Each request must finish within ``timeout``: TransferTimeoutError if not,
    PeerDisconnectedError if the desk is gone, AuthenticationError if it refuses the token."""

    def __init__(self, address: str, *, token: bytes, timeout: timedelta = timedelta(seconds=30)):
        self.address = address
        self._host, self._port = parse_address(address)
        self._token = token
        self._timeout = timeout
        self._sock: socket.socket | None = None

    def __repr__(self) -> str:  # never the token
        return f"DeskClient({self.address})"

    def get(self, name: str) -> bytes | None:
        status, payload = self._request(_Op.GET, name, b"")
        return payload if status == _Status.OK else None

    def put(self, name: str, blob: bytes) -> None:
        self._request(_Op.PUT, name, blob)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def __enter__(self) -> DeskClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self, deadline: HandshakeDeadline) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection((self._host, self._port), timeout=deadline.remaining())
            except TimeoutError as exc:
                raise TransferTimeoutError(f"connecting to the desk at {self.address} timed out") from exc
            except OSError as exc:
                raise PeerDisconnectedError(f"the desk at {self.address}: {exc}") from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                client_handshake(
                    sock,
                    peer=self.address,
                    token=self._token,
                    address=b"",
                    inbound_id=0,
                    timeout_s=deadline.remaining(),
                )
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _request(self, op: _Op, name: str, payload: bytes) -> tuple[_Status, bytes]:
        raw = _check_name(name)
        if len(payload) > MAX_BLOB_BYTES:
            raise ValueError(f"a blob is at most {MAX_BLOB_BYTES} bytes, got {len(payload)}")
        deadline = HandshakeDeadline(self._timeout.total_seconds(), f"{op.name} {name} at the desk {self.address}")
        sock = self._connect(deadline)
        try:
            send_all(sock, _REQUEST.pack(op, len(raw), len(payload)) + raw, deadline)
            if payload:
                send_all(sock, payload, deadline)
            status, size = _ANSWER.unpack(recv_exact(sock, _ANSWER.size, deadline))
            if size > MAX_BLOB_BYTES:
                raise TransportError(f"the desk at {self.address} announced a {size}-byte answer")
            answer = recv_exact(sock, size, deadline) if size else b""
        except BaseException:
            self.close()  # a request cut short leaves the stream mid-frame: the next one reconnects
            raise
        if status == _Status.REFUSED:
            self.close()
            reason = answer.decode(errors="replace")
            raise TransportError(f"the desk at {self.address} refused {op.name} {name}: {reason}")
        return _Status(status), answer
