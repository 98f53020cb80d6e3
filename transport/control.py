"""The control channel every connection starts with: a TCP socket that carries
the token handshake, then stays open so a dead peer is noticed the moment the
kernel closes its socket (milliseconds after ``kill -9``), whatever the data
path is. UCX's own listener would bind every interface and needs endpoint
error handling, which rules out its shared-memory transports; this socket binds
loopback unless configured otherwise, and the data path stays free to be fast.

The accepting side runs each socket's handshake on a thread of its own under
its own deadline, and ``accept()`` hands out only finished ones (see
``EndpointConfig``): a slow peer, or a crowd of silent sockets, delays no one.

Here: the connection and transport every controlled backend (UCX, gloo, IPC, shm)
builds on. Its parts: ``handshake`` (the token handshake and the listening socket),
``framing`` (frames and the monitor thread that reads every socket), ``endpoint``
(the configuration and where a peer is); their public names are re-exported here.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
from abc import abstractmethod
from datetime import timedelta
from typing import Any

from replica.errors import (
    AuthenticationError,
    PeerDisconnectedError,
    ReplicaError,
    TransferTimeoutError,
    TransportError,
)
from replica.timing import Deadline, pause
from replica.transport.base import Connection, Locality, Transport
from replica.transport.endpoint import EndpointConfig, is_local_address, keep_alive, peer_locality
from replica.transport.framing import BYE, GRACEFUL, ControlMonitor, encode_frame
from replica.transport.handshake import (
    ControlServer,
    HandshakeDeadline,
    answer_challenge,
    await_hello,
    client_handshake,
    exchange_verdicts,
    parse_address,
    send_welcome,
    server_handshake,
)

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

_MAX_CONNECTIONS = (1 << 16) - 1
#: How often the accept thread looks whether the transport closed (close() also wakes it).
_ACCEPT_SLICE = timedelta(milliseconds=200)
#: How long close() waits for the accept and handshake threads.
_CLOSE_WAIT = timedelta(seconds=5)
#: Junk-socket floods log one line per interval, not one per socket.
_LOG_INTERVAL = timedelta(seconds=5)


class _RateLimitedLog:
    """Warns at most once per interval; the next warning counts those left out."""

    def __init__(self, interval: timedelta):
        self._interval = interval
        self._lock = threading.Lock()
        self._next = Deadline.now()
        self._skipped = 0

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            if not self._next.expired:
                self._skipped += 1
                return
            skipped, self._skipped = self._skipped, 0
            self._next = Deadline.after(self._interval)
        if skipped:
            msg += f" ({skipped} more like it in the last {self._interval.total_seconds():.0f} s)"
        logger.warning(msg, *args)


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
            raise self._failure() from exc

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
        self._overflow_log = _RateLimitedLog(_LOG_INTERVAL)
        self._failure_log = _RateLimitedLog(_LOG_INTERVAL)
        self._closed = False

    def _listen(self) -> str:
        with self._lock:
            if self._closed:
                raise TransportError("listen() on a closed transport")
            if self._server is None:
                self._server = ControlServer(self._host, self._port)
                self._acceptor = threading.Thread(
                    target=self._accept_loop, args=(self._server,), name="replica-control-accept", daemon=True
                )
                self._acceptor.start()
        return self._server.address

    def _accept(self, timeout_s: float) -> Connection:
        """The next connection that finished its handshake, or the next refusal
        (AuthenticationError: a missing or wrong token), oldest first. A handshake
        cut short by EOF or its deadline is logged, not raised here."""
        if self._server is None:
            raise TransportError("accept() before listen()")
        deadline = Deadline.after(timedelta(seconds=timeout_s))
        with self._arrived:
            while not self._finished:
                if self._closed:
                    raise TransportError("accept() on a closed transport")
                if deadline.expired:
                    raise TransferTimeoutError(
                        f"no peer finished a handshake with {self._server.address} within {timeout_s:.3f} s"
                    )
                self._arrived.wait(deadline.remaining_s())
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
                sock, peer = server.accept(_ACCEPT_SLICE.total_seconds())
            except TransferTimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                # Out of descriptors, most likely: say so, and give the process a moment.
                self._overflow_log.warning("accepting on %s failed: %s", server.address, exc)
                pause(_ACCEPT_SLICE)
                continue
            thread = threading.Thread(target=self._handshake, args=(sock, peer), name="replica-handshake", daemon=True)
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
                        "(max_pending_handshakes)",
                        peer,
                        self._max_pending,
                    )

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        """One accepted socket's handshake, on its own thread, under its own deadline."""
        try:
            conn = self._establish(sock, peer, server=True, timeout_s=self._handshake_timeout_s)
        except BaseException as exc:
            # Why, first: the peer sees its socket close and may act on it at once.
            if isinstance(exc, AuthenticationError):
                pass  # logged where it was found; delivered below
            elif isinstance(exc, TransportError):
                if not self._closed:
                    self._failure_log.warning("handshake with %s failed: %s", peer, exc)
            elif isinstance(exc, Exception):
                logger.exception("handshake with %s failed", peer)
            with self._lock:  # close() shuts down only sockets still listed, never a reused fd
                self._handshakes.pop(sock, None)
                sock.close()
            if isinstance(exc, AuthenticationError):
                self._deliver(exc)  # logged where it was found
            return
        with self._lock:
            self._handshakes.pop(sock, None)
        self._deliver(conn)

    def _deliver(self, item: ControlledConnection | AuthenticationError) -> None:
        with self._arrived:
            if not self._closed:
                # Refusals are logged already; keep no more than could be pending at once.
                if (
                    isinstance(item, ControlledConnection)
                    or sum(isinstance(x, AuthenticationError) for x in self._finished) < self._max_pending
                ):
                    self._finished.append(item)
                    self._arrived.notify()
                return
        if isinstance(item, ControlledConnection):
            item.close()

    def _establish(self, sock: socket.socket, peer: str, *, server: bool, timeout_s: float) -> ControlledConnection:
        """Handshake and open the data path; the caller closes ``sock`` if this raises."""
        deadline = HandshakeDeadline(timeout_s, f"handshake with {peer}")
        keep_alive(sock, self._peer_silence)
        # The server offers (and takes an id) only once the token is proven:
        # junk sockets cost no backend state.
        hello = await_hello(sock, peer=peer, token=self._token, deadline=deadline) if server else None
        recv_id = next(self._ids)
        if recv_id > _MAX_CONNECTIONS:
            raise TransportError(f"more than {_MAX_CONNECTIONS} connections on one transport")
        offer, state = self._offer(server, peer_locality(sock))
        try:
            if hello is not None:
                send_welcome(sock, hello, token=self._token, address=offer, inbound_id=recv_id, deadline=deadline)
                peer_offer, send_id = hello.address, hello.inbound_id
            else:
                peer_offer, send_id = answer_challenge(
                    sock, peer=peer, token=self._token, address=offer, inbound_id=recv_id, deadline=deadline
                )
            try:
                conn = self._open(
                    sock=sock,
                    peer=peer,
                    peer_offer=peer_offer,
                    send_id=send_id,
                    recv_id=recv_id,
                    server=server,
                    state=state,
                    timeout_s=deadline.remaining(),
                )
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
                self._acceptor.join(timeout=_CLOSE_WAIT.total_seconds())
            self._server.close()
        # A thread still opening a data path (gloo's store) finds the transport
        # closed when done and closes what it made.
        deadline = Deadline.after(_CLOSE_WAIT)
        for thread in handshakes:
            thread.join(timeout=deadline.remaining_s())
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
    def _open(
        self,
        *,
        sock: socket.socket,
        peer: str,
        peer_offer: bytes,
        send_id: int,
        recv_id: int,
        server: bool,
        state: Any,
        timeout_s: float,
    ) -> ControlledConnection:
        """Build the data path once both sides proved the token, within ``timeout_s``
        (what is left of the handshake's deadline). On the accepting side it runs
        on a handshake thread, concurrently with other handshakes' ``_offer`` and
        ``_open``; a backend error it raises reaches the peer as a TransportError."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release the backend after every connection is closed."""
