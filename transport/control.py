"""The control channel every connection starts with: a TCP socket that carries
the token handshake, then stays open so a dead peer is noticed the moment the
kernel closes its socket (milliseconds after ``kill -9``), whatever the data
path is. UCX's own listener would bind every interface and needs endpoint
error handling, which rules out its shared-memory transports; this socket binds
loopback unless configured otherwise, and the data path stays free to be fast.

The accepting side runs each socket's handshake on a thread of its own under
its own deadline, and ``accept()`` hands out only finished ones (see
``EndpointConfig``): a slow peer, or a crowd of silent sockets, delays no one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import ipaddress
import itertools
import logging
import selectors
import socket
import struct
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from replica.errors import (
    AuthenticationError,
    PeerDisconnectedError,
    ReplicaError,
    TransferTimeoutError,
    TransportError,
)
from replica.transport import wire
from replica.transport.base import Connection, Locality, Transport, check_verify_threads

__all__ = [
    "BYE",
    "ControlMonitor",
    "ControlServer",
    "ControlledConnection",
    "ControlledTransport",
    "EndpointConfig",
    "client_handshake",
    "encode_frame",
    "exchange_verdicts",
    "is_local_address",
    "keep_alive",
    "parse_address",
    "peer_locality",
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


# A verdict's reason, at most (longer ones are cut).
_MAX_VERDICT_BYTES = 1024


def exchange_verdicts(sock: socket.socket, reason: str, *, peer: str, timeout_s: float) -> str:
    """Tell the peer whether this side accepts the data path the handshake offered (``reason``:
    why not, "" when it does) and return the peer's own verdict, within ``timeout_s``. Both
    sides send first, then read, so neither waits on the other; called from ``_open``, before
    the control monitor reads the socket."""
    deadline = _Deadline(timeout_s, f"handshake with {peer}")
    said = reason.encode("utf-8", "replace")[:_MAX_VERDICT_BYTES]
    _send_all(sock, struct.pack("<H", len(said)) + said, deadline)
    (n,) = struct.unpack("<H", _recv_exact(sock, 2, deadline))
    if n > _MAX_VERDICT_BYTES:
        raise TransportError(f"{peer} sent a {n}-byte verdict in its handshake")
    said = _recv_exact(sock, n, deadline).decode("utf-8", "replace") if n else ""
    return "".join(c if c.isprintable() else "?" for c in said)  # it is logged: no control characters


MAX_ADDRESS_BYTES = 1 << 16


def _read_address(sock, deadline):
    def read(length: int) -> bytes:
        if length > MAX_ADDRESS_BYTES:
            raise ValueError(f"peer announced a {length}-byte address")
        return _recv_exact(sock, length, deadline)
    return read


def _await_hello(sock: socket.socket, *, peer: str, token: bytes, deadline: _Deadline) -> wire.Hello:
    """Server side, first half: challenge the client and check its proof of the token.

    Junk or a wrong proof is an AuthenticationError (logged: who, never the token);
    a client that vanishes or stalls meanwhile is a PeerDisconnectedError or
    TransferTimeoutError, since that is no evidence of a wrong token."""
    nonce = wire.new_nonce()
    _send_all(sock, wire.encode_challenge(nonce), deadline)
    try:
        hello = wire.Hello.decode(_recv_exact(sock, wire.Hello.fixed_size(), deadline),
                                  _read_address(sock, deadline))
    except ValueError as exc:
        logger.warning("refused connection from %s: no valid job token (%s)", peer, exc)
        raise AuthenticationError(f"{peer} did not present a job token: {exc}") from exc
    if not hmac.compare_digest(hello.proof, wire.proof(token, nonce, b"client")):
        logger.warning("refused connection from %s: wrong job token", peer)
        refusal = wire.Welcome(accepted=False, proof=bytes(wire.PROOF_BYTES), inbound_id=0, address=b"")
        with contextlib.suppress(TransportError):  # refused either way, even if it is gone already
            _send_all(sock, refusal.encode(), deadline)
        raise AuthenticationError(f"{peer} presented a wrong job token")
    return hello


def _send_welcome(sock: socket.socket, hello: wire.Hello, *, token: bytes, address: bytes,
                  inbound_id: int, deadline: _Deadline) -> None:
    """Server side, second half: prove the token back and tell the client where to send."""
    welcome = wire.Welcome(accepted=True, proof=wire.proof(token, hello.nonce, b"server"),
                           inbound_id=inbound_id, address=address)
    _send_all(sock, welcome.encode(), deadline)


def server_handshake(sock: socket.socket, *, peer: str, token: bytes, address: bytes,
                     inbound_id: int, timeout_s: float) -> tuple[bytes, int]:
    """Challenge the client for the job token; returns its data address and tag id.

    Raises AuthenticationError for a missing or wrong token; PeerDisconnectedError
    or TransferTimeoutError (retryable) when the client closes or stalls."""
    deadline = _Deadline(timeout_s, f"handshake with {peer}")
    hello = _await_hello(sock, peer=peer, token=token, deadline=deadline)
    _send_welcome(sock, hello, token=token, address=address, inbound_id=inbound_id, deadline=deadline)
    return hello.address, hello.inbound_id


def _client_handshake(sock: socket.socket, *, peer: str, token: bytes, address: bytes,
                      inbound_id: int, deadline: _Deadline) -> tuple[bytes, int]:
    try:
        server_nonce = wire.decode_challenge(_recv_exact(sock, wire.CHALLENGE_BYTES, deadline))
    except ValueError as exc:
        raise TransportError(f"{peer} is not a replica endpoint: {exc}") from exc
    nonce = wire.new_nonce()
    hello = wire.Hello(proof=wire.proof(token, server_nonce, b"client"), nonce=nonce,
                       inbound_id=inbound_id, address=address)
    _send_all(sock, hello.encode(), deadline)
    # A server that refuses the token says so in its Welcome: an EOF or a stall
    # here (it died, dropped a stalled handshake, or was at its cap) stays a
    # PeerDisconnectedError / TransferTimeoutError, which callers may retry.
    try:
        welcome = wire.Welcome.decode(_recv_exact(sock, wire.Welcome.fixed_size(), deadline),
                                      _read_address(sock, deadline))
    except ValueError as exc:
        raise TransportError(f"{peer} is not a replica endpoint: {exc}") from exc
    if not welcome.accepted:
        raise AuthenticationError(f"{peer} refused this side's job token")
    if not hmac.compare_digest(welcome.proof, wire.proof(token, nonce, b"server")):
        raise AuthenticationError(f"{peer} could not prove it holds the job token")
    return welcome.address, welcome.inbound_id


def client_handshake(sock: socket.socket, *, peer: str, token: bytes, address: bytes,
                     inbound_id: int, timeout_s: float) -> tuple[bytes, int]:
    """Answer the server's challenge and check its own proof; returns its data address and tag id.

    Raises AuthenticationError when the server refuses this side's token or cannot
    prove its own; PeerDisconnectedError or TransferTimeoutError (retryable) when
    it closes or stalls."""
    return _client_handshake(sock, peer=peer, token=token, address=address, inbound_id=inbound_id,
                             deadline=_Deadline(timeout_s, f"handshake with {peer}"))


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

    def shutdown(self) -> None:
        """Wake a thread blocked in ``accept`` (it raises OSError); ``close`` follows."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

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
        # Set when a socket is watched: an idle monitor (nothing to select on) wakes at
        # once, not at its next look, so a new connection's first frames wait for nothing.
        self._watched = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-control-monitor", daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket, conn: ControlledConnection) -> None:
        # Timeout mode, not non-blocking: recv runs only after select said the
        # socket is readable, and a frame send may block for a bounded time.
        sock.settimeout(SEND_TIMEOUT_S)
        self._selector.register(sock, selectors.EVENT_READ, (conn, bytearray()))
        self._watched.set()

    def forget(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def close(self) -> None:
        self._stopped.set()
        self._watched.set()
        self._thread.join(timeout=5)
        self._selector.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._selector.get_map():
                self._watched.wait(0.05)
                self._watched.clear()
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
#: How often the accept thread looks whether the transport closed (close() also wakes it).
_ACCEPT_SLICE_S = 0.2
#: How long close() waits for the accept and handshake threads.
_CLOSE_WAIT_S = 5.0
#: Junk-socket floods log one line per interval, not one per socket.
_LOG_INTERVAL_S = 5.0


class _RateLimitedLog:
    """Warns at most once per interval; the next warning counts those left out."""

    def __init__(self, interval_s: float):
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._skipped = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._skipped += 1
                return
            skipped, self._skipped = self._skipped, 0
            self._next = now + self._interval_s
        if skipped:
            msg += f" ({skipped} more like it in the last {self._interval_s:.0f} s)"
        logger.warning(msg, *args)


@dataclass(kw_only=True, frozen=True, slots=True)
class EndpointConfig:
    """What every backend's config has: the job token, where ``listen()`` binds
    (loopback unless told otherwise), whether buckets carry digests, and how
    accepted connections authenticate.

    Each accepted connection proves the token and opens its data path on a
    thread of its own, within ``handshake_timeout`` whatever timeout the caller
    gives ``accept()``; ``accept()`` only hands out connections that finished,
    so a slow or silent peer delays no other. One that takes longer is dropped,
    and its ``connect()`` sees a retryable TransportError. At most
    ``max_pending_handshakes`` handshakes run at once: a socket accepted beyond
    that is closed at once (logged at most every few seconds), so idle or junk
    sockets cannot use up threads; a genuine peer refused that way also sees a
    retryable PeerDisconnectedError.
    """

    token: bytes
    host: str = "127.0.0.1"
    port: int = 0
    verify: bool = True
    # Threads a receiver hashes each piece of a host-memory bucket with, while
    # the next arrives (0: every core this process may run on but two, which
    # stay with the transport and the caller; at least one, at most AUTO_VERIFY_THREADS_MAX).
    verify_threads: int = 0
    handshake_timeout: timedelta = timedelta(seconds=10)
    max_pending_handshakes: int = 64
    # A peer whose machine stops answering (lost, or cut off by a partition: no
    # reset ever comes) is reported lost after about this long, by the kernel's
    # TCP keepalive on the control socket (see ``keep_alive``). A live process
    # that is slow or stopped still answers: its kernel does.
    peer_silence: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or not self.token:
            raise ValueError("token must be non-empty bytes (the job's secret)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        check_verify_threads(self.verify_threads)
        if not isinstance(self.handshake_timeout, timedelta) or self.handshake_timeout <= timedelta(0):
            raise ValueError(f"handshake_timeout must be a positive timedelta, got {self.handshake_timeout!r}")
        if isinstance(self.max_pending_handshakes, bool) or not isinstance(self.max_pending_handshakes, int) \
                or self.max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be an int >= 1, got {self.max_pending_handshakes!r}")
        if not isinstance(self.peer_silence, timedelta) or self.peer_silence < timedelta(seconds=2):
            raise ValueError(f"peer_silence must be a timedelta of at least 2 s, got {self.peer_silence!r}")

    def __repr__(self) -> str:  # never print the token
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "token")
        return f"{type(self).__name__}({shown})"


def keep_alive(sock: socket.socket, silence: timedelta) -> None:
    """Have the kernel fail ``sock`` once its peer's machine has not answered for about
    ``silence``: keepalive probes each second after a second idle, and a limit on how
    long sent data may stay unacknowledged. Where the platform lacks an option
    (not Linux), the one it has stays; heartbeats find the peer all the same."""
    seconds = max(2, int(silence.total_seconds()))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", seconds - 1),
                        ("TCP_USER_TIMEOUT", seconds * 1000)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def is_local_address(host: str) -> bool:
    """Whether ``host`` (an IP address) is one of this network namespace's own: a
    socket can bind it. Peers in other namespaces (other machines, containers,
    the test cluster's hosts) are not local even when they share /dev/shm."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if address.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def peer_locality(sock: socket.socket) -> Locality:
    """SAME_NODE when the control socket's peer has an address of this host."""
    try:
        host = sock.getpeername()[0]
    except OSError:
        return Locality.REMOTE
    return Locality.SAME_NODE if is_local_address(host) else Locality.REMOTE


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
            # Bytes the peer sent that nobody read would make the close a reset, and a
            # reset drops what this side sent last (the peer's last frames still in flight
            # to it: a reply, a bucket) before the peer reads it: read them first.
            self._sock.setblocking(False)
            while self._sock.recv(1 << 16):
                pass
        except OSError:
            pass  # nothing more to read, or the peer is gone already
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
        self._handshake_timeout_s = config.handshake_timeout.total_seconds()
        self._max_pending = config.max_pending_handshakes
        self._peer_silence = config.peer_silence
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._connections: set[ControlledConnection] = set()
        self._monitor = ControlMonitor()
        self._server: ControlServer | None = None
        self._acceptor: threading.Thread | None = None
        # Under _lock: the sockets still authenticating and their threads, and
        # what they produced for accept() (connections, refusals), in order.
        self._handshakes: dict[socket.socket, threading.Thread] = {}
        self._arrived = threading.Condition(self._lock)
        self._finished: collections.deque[ControlledConnection | AuthenticationError] = collections.deque()
        self._overflow_log = _RateLimitedLog(_LOG_INTERVAL_S)
        self._failure_log = _RateLimitedLog(_LOG_INTERVAL_S)
        self._closed = False

    def _listen(self) -> str:
        with self._lock:
            if self._closed:
                raise TransportError("listen() on a closed transport")
            if self._server is None:
                self._server = ControlServer(self._host, self._port)
                self._acceptor = threading.Thread(target=self._accept_loop, args=(self._server,),
                                                  name="replica-control-accept", daemon=True)
                self._acceptor.start()
        return self._server.address

    def _accept(self, timeout_s: float) -> Connection:
        """The next connection that finished its handshake, or the next refusal
        (AuthenticationError: a missing or wrong token), oldest first. A handshake
        cut short by EOF or its deadline is logged, not raised here."""
        if self._server is None:
            raise TransportError("accept() before listen()")
        end = time.monotonic() + timeout_s
        with self._arrived:
            while not self._finished:
                if self._closed:
                    raise TransportError("accept() on a closed transport")
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"no peer finished a handshake with {self._server.address} "
                                               f"within {timeout_s:.3f} s")
                self._arrived.wait(left)
            item = self._finished.popleft()
        if isinstance(item, AuthenticationError):
            raise item
        return item

    def _connect(self, address: str, timeout_s: float) -> Connection:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerDisconnectedError(f"cannot connect to {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._establish(sock, address, server=False, timeout_s=timeout_s)
        except BaseException:
            sock.close()
            raise

    def _accept_loop(self, server: ControlServer) -> None:
        while not self._closed:
            try:
                sock, peer = server.accept(_ACCEPT_SLICE_S)
            except TransferTimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                # Out of descriptors, most likely: say so, and give the process a moment.
                self._overflow_log.warning("accepting on %s failed: %s", server.address, exc)
                time.sleep(_ACCEPT_SLICE_S)
                continue
            thread = threading.Thread(target=self._handshake, args=(sock, peer), name="replica-handshake",
                                      daemon=True)
            with self._lock:
                refused = self._closed or len(self._handshakes) >= self._max_pending
                if not refused:
                    self._handshakes[sock] = thread
                    thread.start()  # under the lock, so close() never joins an unstarted thread
            if refused:
                sock.close()
                if not self._closed:
                    self._overflow_log.warning(
                        "closed the connection from %s at once: %d handshakes are already pending "
                        "(max_pending_handshakes)", peer, self._max_pending)

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        """One accepted socket's handshake, on its own thread, under its own deadline."""
        try:
            conn = self._establish(sock, peer, server=True, timeout_s=self._handshake_timeout_s)
        except BaseException as exc:
            with self._lock:  # close() shuts down only sockets still listed, never a reused fd
                self._handshakes.pop(sock, None)
                sock.close()
            if isinstance(exc, AuthenticationError):
                self._deliver(exc)  # logged where it was found
            elif isinstance(exc, TransportError):
                if not self._closed:
                    self._failure_log.warning("handshake with %s failed: %s", peer, exc)
            elif isinstance(exc, Exception):
                logger.exception("handshake with %s failed", peer)
            return
        with self._lock:
            self._handshakes.pop(sock, None)
        self._deliver(conn)

    def _deliver(self, item: ControlledConnection | AuthenticationError) -> None:
        with self._arrived:
            if not self._closed:
                # Refusals are logged already; keep no more than could be pending at once.
                if isinstance(item, ControlledConnection) or \
                        sum(isinstance(x, AuthenticationError) for x in self._finished) < self._max_pending:
                    self._finished.append(item)
                    self._arrived.notify()
                return
        if isinstance(item, ControlledConnection):
            item.close()

    def _establish(self, sock: socket.socket, peer: str, *, server: bool, timeout_s: float) -> ControlledConnection:
        """Handshake and open the data path; the caller closes ``sock`` if this raises."""
        deadline = _Deadline(timeout_s, f"handshake with {peer}")
        keep_alive(sock, self._peer_silence)
        # The server offers (and takes an id) only once the token is proven:
        # junk sockets cost no backend state.
        hello = _await_hello(sock, peer=peer, token=self._token, deadline=deadline) if server else None
        recv_id = next(self._ids)
        if recv_id > _MAX_CONNECTIONS:
            raise TransportError(f"more than {_MAX_CONNECTIONS} connections on one transport")
        offer, state = self._offer(server, peer_locality(sock))
        try:
            if hello is not None:
                _send_welcome(sock, hello, token=self._token, address=offer, inbound_id=recv_id, deadline=deadline)
                peer_offer, send_id = hello.address, hello.inbound_id
            else:
                peer_offer, send_id = _client_handshake(sock, peer=peer, token=self._token, address=offer,
                                                        inbound_id=recv_id, deadline=deadline)
            try:
                conn = self._open(sock=sock, peer=peer, peer_offer=peer_offer, send_id=send_id,
                                  recv_id=recv_id, server=server, state=state, timeout_s=deadline.remaining())
            except ReplicaError:
                raise
            except Exception as exc:  # a backend's own error (gloo's store, UCX): the peer may try again
                raise TransportError(f"opening the data path with {peer} failed: {exc}") from exc
        except BaseException:
            self._discard_offer(state)
            raise
        with self._lock:  # close() sees the connection watched, or this sees close()
            closed = self._closed
            if not closed:
                self._connections.add(conn)
                self._monitor.watch(sock, conn)
        if closed:
            conn.close()
            raise TransportError(f"transport closed during the handshake with {peer}")
        logger.info("connected to %s", peer)
        return conn

    def _forget(self, conn: ControlledConnection) -> None:
        self._monitor.forget(conn._sock)
        with self._lock:
            self._connections.discard(conn)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handshakes = list(self._handshakes.values())
            for sock in self._handshakes:  # wakes each handshake thread; it closes its socket
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            unclaimed = [item for item in self._finished if isinstance(item, ControlledConnection)]
            self._finished.clear()
            self._arrived.notify_all()
        if self._server is not None:
            self._server.shutdown()
            if self._acceptor is not None:
                self._acceptor.join(timeout=_CLOSE_WAIT_S)
            self._server.close()
        # A thread still opening a data path (gloo's store) finds the transport
        # closed when done and closes what it made.
        end = time.monotonic() + _CLOSE_WAIT_S
        for thread in handshakes:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        for conn in unclaimed:
            conn.close()
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.close()
        self._monitor.close()
        self._shutdown()

    @abstractmethod
    def _offer(self, server: bool, locality: Locality) -> tuple[bytes, Any]:
        """What this side sends the peer in the handshake (its data address), and local
        state; ``locality``: where the peer runs, seen from the control socket."""

    def _discard_offer(self, state: Any) -> None:
        """Undo ``_offer`` when the handshake fails (or ``_open`` raised)."""

    @abstractmethod
    def _open(self, *, sock: socket.socket, peer: str, peer_offer: bytes, send_id: int, recv_id: int,
              server: bool, state: Any, timeout_s: float) -> ControlledConnection:
        """Build the data path once both sides proved the token, within ``timeout_s``
        (what is left of the handshake's deadline). On the accepting side it runs
        on a handshake thread, concurrently with other handshakes' ``_offer`` and
        ``_open``; a backend error it raises reaches the peer as a TransportError."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release the backend after every connection is closed."""
