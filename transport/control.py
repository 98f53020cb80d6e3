"""The control channel every connection starts with: a TCP socket that carries
the token handshake, then stays open so a dead peer is noticed the moment the
kernel closes its socket (milliseconds after ``kill -9``), whatever the data
path is. UCX's own listener would bind every interface and needs endpoint
error handling, which rules out its shared-memory transports; this socket binds
loopback unless configured otherwise, and the data path stays free to be fast.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import selectors
import socket
import struct
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from replica.errors import AuthenticationError, PeerDisconnectedError, TransferTimeoutError, TransportError
from replica.transport import wire
from replica.transport.base import Connection, Transport

__all__ = [
    "BYE",
    "ControlMonitor",
    "ControlServer",
    "ControlledConnection",
    "ControlledTransport",
    "EndpointConfig",
    "client_handshake",
    "encode_frame",
    "parse_address",
    "server_handshake",
]

logger = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must look like HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class _Deadline:
    def __init__(self, timeout_s: float, what: str):
        self.end = time.monotonic() + timeout_s
        self.what = what

    def remaining(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{self.what} timed out")
        return left


def _recv_exact(sock: socket.socket, n: int, deadline: _Deadline) -> bytes:
    chunks = []
    while n:
        sock.settimeout(deadline.remaining())
        try:
            chunk = sock.recv(n)
        except TimeoutError as exc:
            raise TransferTimeoutError(f"{deadline.what} timed out") from exc
        except OSError as exc:
            raise PeerDisconnectedError(f"{deadline.what}: {exc}") from exc
        if not chunk:
            raise PeerDisconnectedError(f"{deadline.what}: peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send_all(sock: socket.socket, data: bytes, deadline: _Deadline) -> None:
    sock.settimeout(deadline.remaining())
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise TransferTimeoutError(f"{deadline.what} timed out") from exc
    except OSError as exc:
        raise PeerDisconnectedError(f"{deadline.what}: {exc}") from exc


MAX_ADDRESS_BYTES = 1 << 16


def _read_address(sock, deadline):
    def read(length: int) -> bytes:
        if length > MAX_ADDRESS_BYTES:
            raise ValueError(f"peer announced a {length}-byte address")
        return _recv_exact(sock, length, deadline)
    return read


def server_handshake(sock: socket.socket, *, peer: str, token: bytes, address: bytes,
                     inbound_id: int, timeout_s: float) -> tuple[bytes, int]:
    """Challenge the client for the job token; returns its data address and tag id."""
    deadline = _Deadline(timeout_s, f"handshake with {peer}")
    nonce = wire.new_nonce()
    _send_all(sock, wire.encode_challenge(nonce), deadline)
    try:
        hello = wire.Hello.decode(_recv_exact(sock, wire.Hello.fixed_size(), deadline),
                                  _read_address(sock, deadline))
    except (ValueError, PeerDisconnectedError, TransferTimeoutError) as exc:
        logger.warning("refused connection from %s: no valid job token (%s)", peer, exc)
        raise AuthenticationError(f"{peer} did not present a job token: {exc}") from exc
    if not hmac.compare_digest(hello.proof, wire.proof(token, nonce, b"client")):
        _send_all(sock, wire.Welcome(accepted=False, proof=bytes(wire.PROOF_BYTES), inbound_id=0,
                                     address=b"").encode(), deadline)
        logger.warning("refused connection from %s: wrong job token", peer)
        raise AuthenticationError(f"{peer} presented a wrong job token")
    welcome = wire.Welcome(accepted=True, proof=wire.proof(token, hello.nonce, b"server"),
                           inbound_id=inbound_id, address=address)
    _send_all(sock, welcome.encode(), deadline)
    return hello.address, hello.inbound_id


def client_handshake(sock: socket.socket, *, peer: str, token: bytes, address: bytes,
                     inbound_id: int, timeout_s: float) -> tuple[bytes, int]:
    """Answer the server's challenge and check its own proof; returns its data address and tag id."""
    deadline = _Deadline(timeout_s, f"handshake with {peer}")
    try:
        server_nonce = wire.decode_challenge(_recv_exact(sock, wire.CHALLENGE_BYTES, deadline))
    except ValueError as exc:
        raise TransportError(f"{peer} is not a replica endpoint: {exc}") from exc
    nonce = wire.new_nonce()
    hello = wire.Hello(proof=wire.proof(token, server_nonce, b"client"), nonce=nonce,
                       inbound_id=inbound_id, address=address)
    _send_all(sock, hello.encode(), deadline)
    try:
        welcome = wire.Welcome.decode(_recv_exact(sock, wire.Welcome.fixed_size(), deadline),
                                      _read_address(sock, deadline))
    except PeerDisconnectedError as exc:
        raise AuthenticationError(f"{peer} closed the connection during the handshake") from exc
    if not welcome.accepted:
        raise AuthenticationError(f"{peer} refused this side's job token")
    if not hmac.compare_digest(welcome.proof, wire.proof(token, nonce, b"server")):
        raise AuthenticationError(f"{peer} could not prove it holds the job token")
    return welcome.address, welcome.inbound_id


class ControlServer:
    """The listening socket (loopback unless told otherwise)."""

    def __init__(self, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address = f"[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"{bound_host}:{bound_port}"

    def accept(self, timeout_s: float) -> tuple[socket.socket, str]:
        self._sock.settimeout(timeout_s)
        try:
            sock, addr = self._sock.accept()
        except TimeoutError as exc:
            raise TransferTimeoutError(f"no peer connected to {self.address} within {timeout_s:.3f} s") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, f"{addr[0]}:{addr[1]}"

    def close(self) -> None:
        self._sock.close()


#: Frames on the control socket after the handshake: kind (u8), length (u32), payload.
_FRAME = struct.Struct("<BI")
BYE = 0xFF  # the peer closes on purpose
MAX_FRAME_BYTES = 1 << 20
GRACEFUL = "peer closed the connection"  # it sent BYE
#: How long a control-frame send may block before the connection counts as dead.
SEND_TIMEOUT_S = 10.0


def encode_frame(kind: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


class ControlMonitor:
    """One thread reading every control socket of a transport: it hands framed
    messages to their connection and tells it when the peer is gone.

    epoll allows registering while another thread waits, so watch/forget need
    no wake-up; the one-second select timeout only bounds how long close() waits.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-control-monitor", daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket, conn: ControlledConnection) -> None:
        # Timeout mode, not non-blocking: recv runs only after select said the
        # socket is readable, and a frame send may block for a bounded time.
        sock.settimeout(SEND_TIMEOUT_S)
        self._selector.register(sock, selectors.EVENT_READ, (conn, bytearray()))

    def forget(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._selector.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._selector.get_map():
                self._stopped.wait(0.05)
                continue
            for key, _ in self._selector.select(timeout=1.0):
                conn, pending = key.data
                reason = self._read(key.fileobj, conn, pending)
                if reason is not None:
                    self.forget(key.fileobj)
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
            payload = bytes(pending[_FRAME.size:_FRAME.size + length])
            del pending[:_FRAME.size + length]
            try:
                conn._on_control(kind, payload)
            except Exception as exc:  # noqa: BLE001 - a bad frame ends the connection, not the monitor
                return f"bad control frame {kind}: {exc}"
        return None


_MAX_CONNECTIONS = (1 << 16) - 1


@dataclass(kw_only=True, frozen=True, slots=True)
class EndpointConfig:
    """What every backend's config has: the job token, where ``listen()`` binds
    (loopback unless told otherwise), and whether buckets carry digests."""

    token: bytes
    host: str = "127.0.0.1"
    port: int = 0
    verify: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or not self.token:
            raise ValueError("token must be non-empty bytes (the job's secret)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def __repr__(self) -> str:  # never print the token
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "token")
        return f"{type(self).__name__}({shown})"


class ControlledConnection(Connection):
    """A connection whose liveness is its control socket, which can also carry
    small framed messages (``_send_control`` / ``_on_control``)."""

    def __init__(self, *, transport: ControlledTransport, sock: socket.socket, peer: str, **kwargs: Any):
        super().__init__(peer=peer, **kwargs)
        self._transport = transport
        self._sock = sock
        self._send_lock = threading.Lock()

    def _peer_lost(self, reason: str) -> None:
        self._fail(PeerDisconnectedError(f"{self.peer}: {reason}", graceful=reason == GRACEFUL))

    def _send_control(self, kind: int, payload: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(encode_frame(kind, payload))
        except OSError as exc:
            self._peer_lost(f"control send failed: {exc}")
            raise self._error from exc

    def _on_control(self, kind: int, payload: bytes) -> None:
        raise TransportError(f"unexpected control frame {kind}")

    def _abort(self) -> None:
        self._transport._forget(self)
        try:
            self._sock.settimeout(0.1)
            with self._send_lock:
                self._sock.sendall(encode_frame(BYE))
        except OSError:
            pass  # the peer is gone already
        self._sock.close()
        self._release()

    @abstractmethod
    def _release(self) -> None:
        """Free the data path; operations in flight must stop or be abandoned."""


class ControlledTransport(Transport):
    """listen/accept/connect over an authenticated control socket; backends supply
    the data path through ``_offer`` (what this side tells the peer) and ``_open``."""

    def __init__(self, config: EndpointConfig):
        self._token = config.token
        self._host = config.host
        self._port = config.port
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._connections: set[ControlledConnection] = set()
        self._monitor = ControlMonitor()
        self._server: ControlServer | None = None
        self._closed = False

    def _listen(self) -> str:
        if self._server is None:
            self._server = ControlServer(self._host, self._port)
        return self._server.address

    def _accept(self, timeout_s: float) -> Connection:
        if self._server is None:
            raise TransportError("accept() before listen()")
        sock, peer = self._server.accept(timeout_s)
        return self._establish(sock, peer, server=True, timeout_s=timeout_s)

    def _connect(self, address: str, timeout_s: float) -> Connection:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerDisconnectedError(f"cannot connect to {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._establish(sock, address, server=False, timeout_s=timeout_s)

    def _establish(self, sock: socket.socket, peer: str, *, server: bool, timeout_s: float) -> Connection:
        recv_id = next(self._ids)
        if recv_id > _MAX_CONNECTIONS:
            sock.close()
            raise TransportError(f"more than {_MAX_CONNECTIONS} connections on one transport")
        handshake = server_handshake if server else client_handshake
        offer, state = self._offer(server)
        try:
            peer_offer, send_id = handshake(sock, peer=peer, token=self._token, address=offer,
                                            inbound_id=recv_id, timeout_s=timeout_s)
            conn = self._open(sock=sock, peer=peer, peer_offer=peer_offer, send_id=send_id,
                              recv_id=recv_id, server=server, state=state, timeout_s=timeout_s)
        except BaseException:
            sock.close()
            self._discard_offer(state)
            raise
        with self._lock:
            self._connections.add(conn)
        self._monitor.watch(sock, conn)
        logger.info("connected to %s", peer)
        return conn

    def _forget(self, conn: ControlledConnection) -> None:
        self._monitor.forget(conn._sock)
        with self._lock:
            self._connections.discard(conn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.close()
        if self._server is not None:
            self._server.close()
        self._monitor.close()
        self._shutdown()

    @abstractmethod
    def _offer(self, server: bool) -> tuple[bytes, Any]:
        """What this side sends the peer in the handshake (its data address), and local state."""

    def _discard_offer(self, state: Any) -> None:
        """Undo ``_offer`` when the handshake fails."""

    @abstractmethod
    def _open(self, *, sock: socket.socket, peer: str, peer_offer: bytes, send_id: int, recv_id: int,
              server: bool, state: Any, timeout_s: float) -> ControlledConnection:
        """Build the data path once both sides proved the token."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release the backend after every connection is closed."""
