"""The control socket's handshake: both sides prove they hold the job's token (HMAC
over fresh nonces, ``replica.transport.wire``), exchange addresses and verdicts, under
one deadline; and the listening socket that accepts them (``ControlServer``)."""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import struct
from datetime import timedelta

from replica.errors import AuthenticationError, PeerDisconnectedError, TransferTimeoutError, TransportError
from replica.timing import Deadline
from replica.transport import wire

__all__ = [
    "ControlServer",
    "HandshakeDeadline",
    "MAX_ADDRESS_BYTES",
    "answer_challenge",
    "await_hello",
    "client_handshake",
    "exchange_verdicts",
    "parse_address",
    "recv_exact",
    "send_all",
    "send_welcome",
    "server_handshake",
]

logger = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must look like HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class HandshakeDeadline:
    """A handshake's ``Deadline``, in the seconds a socket's timeout takes: ``remaining()``
    raises ``TransferTimeoutError`` naming what timed out once it has passed."""

    def __init__(self, timeout_s: float, what: str):
        self._deadline = Deadline.after(timedelta(seconds=timeout_s))
        self.what = what

    def remaining(self) -> float:
        if self._deadline.expired:
            raise TransferTimeoutError(f"{self.what} timed out")
        return self._deadline.remaining_s()


def recv_exact(sock: socket.socket, n: int, deadline: HandshakeDeadline) -> bytes:
    """Exactly ``n`` bytes, read into one buffer (a desk's blob may be hundreds of MB)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(deadline.remaining())
        try:
            chunk = sock.recv_into(view[got:], n - got)
        except TimeoutError as exc:
            raise TransferTimeoutError(f"{deadline.what} timed out") from exc
        except OSError as exc:
            raise PeerDisconnectedError(f"{deadline.what}: {exc}") from exc
        if not chunk:
            raise PeerDisconnectedError(f"{deadline.what}: peer closed the connection")
        got += chunk
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, deadline: HandshakeDeadline) -> None:
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
    deadline = HandshakeDeadline(timeout_s, f"handshake with {peer}")
    said = reason.encode("utf-8", "replace")[:_MAX_VERDICT_BYTES]
    send_all(sock, struct.pack("<H", len(said)) + said, deadline)
    (n,) = struct.unpack("<H", recv_exact(sock, 2, deadline))
    if n > _MAX_VERDICT_BYTES:
        raise TransportError(f"{peer} sent a {n}-byte verdict in its handshake")
    said = recv_exact(sock, n, deadline).decode("utf-8", "replace") if n else ""
    return "".join(c if c.isprintable() else "?" for c in said)  # it is logged: no control characters


MAX_ADDRESS_BYTES = 1 << 16


def _read_address(sock, deadline):
    def read(length: int) -> bytes:
        if length > MAX_ADDRESS_BYTES:
            raise ValueError(f"peer announced a {length}-byte address")
        return recv_exact(sock, length, deadline)

    return read


def await_hello(sock: socket.socket, *, peer: str, token: bytes, deadline: HandshakeDeadline) -> wire.Hello:
    """Server side, first half: challenge the client and check its proof of the token.

    Junk or a wrong proof is an AuthenticationError (logged: who, never the token);
    a client that vanishes or stalls meanwhile is a PeerDisconnectedError or
    TransferTimeoutError, since that is no evidence of a wrong token."""
    nonce = wire.new_nonce()
    send_all(sock, wire.encode_challenge(nonce), deadline)
    try:
        hello = wire.Hello.decode(recv_exact(sock, wire.Hello.fixed_size(), deadline), _read_address(sock, deadline))
    except ValueError as exc:
        logger.warning("refused connection from %s: no valid job token (%s)", peer, exc)
        raise AuthenticationError(f"{peer} did not present a job token: {exc}") from exc
    if not hmac.compare_digest(hello.proof, wire.proof(token, nonce, b"client")):
        logger.warning("refused connection from %s: wrong job token", peer)
        refusal = wire.Welcome(accepted=False, proof=bytes(wire.PROOF_BYTES), inbound_id=0, address=b"")
        with contextlib.suppress(TransportError):  # refused either way, even if it is gone already
            send_all(sock, refusal.encode(), deadline)
        raise AuthenticationError(f"{peer} presented a wrong job token")
    return hello


def send_welcome(
    sock: socket.socket,
    hello: wire.Hello,
    *,
    token: bytes,
    address: bytes,
    inbound_id: int,
    deadline: HandshakeDeadline,
) -> None:
    """Server side, second half: prove the token back and tell the client where to send."""
    welcome = wire.Welcome(
        accepted=True, proof=wire.proof(token, hello.nonce, b"server"), inbound_id=inbound_id, address=address
    )
    send_all(sock, welcome.encode(), deadline)


def server_handshake(
    sock: socket.socket, *, peer: str, token: bytes, address: bytes, inbound_id: int, timeout_s: float
) -> tuple[bytes, int]:
    """Challenge the client for the job token; returns its data address and tag id.

    Raises AuthenticationError for a missing or wrong token; PeerDisconnectedError
    or TransferTimeoutError (retryable) when the client closes or stalls."""
    deadline = HandshakeDeadline(timeout_s, f"handshake with {peer}")
    hello = await_hello(sock, peer=peer, token=token, deadline=deadline)
    send_welcome(sock, hello, token=token, address=address, inbound_id=inbound_id, deadline=deadline)
    return hello.address, hello.inbound_id


def answer_challenge(
    sock: socket.socket, *, peer: str, token: bytes, address: bytes, inbound_id: int, deadline: HandshakeDeadline
) -> tuple[bytes, int]:
    try:
        server_nonce = wire.decode_challenge(recv_exact(sock, wire.CHALLENGE_BYTES, deadline))
    except ValueError as exc:
        raise TransportError(f"{peer} is not a replica endpoint: {exc}") from exc
    nonce = wire.new_nonce()
    hello = wire.Hello(
        proof=wire.proof(token, server_nonce, b"client"), nonce=nonce, inbound_id=inbound_id, address=address
    )
    send_all(sock, hello.encode(), deadline)
    # A server that refuses the token says so in its Welcome: an EOF or a stall
    # here (it died, dropped a stalled handshake, or was at its cap) stays a
    # PeerDisconnectedError / TransferTimeoutError, which callers may retry.
    try:
        welcome = wire.Welcome.decode(
            recv_exact(sock, wire.Welcome.fixed_size(), deadline), _read_address(sock, deadline)
        )
    except ValueError as exc:
        raise TransportError(f"{peer} is not a replica endpoint: {exc}") from exc
    if not welcome.accepted:
        raise AuthenticationError(f"{peer} refused this side's job token")
    if not hmac.compare_digest(welcome.proof, wire.proof(token, nonce, b"server")):
        raise AuthenticationError(f"{peer} could not prove it holds the job token")
    return welcome.address, welcome.inbound_id


def client_handshake(
    sock: socket.socket, *, peer: str, token: bytes, address: bytes, inbound_id: int, timeout_s: float
) -> tuple[bytes, int]:
    """Answer the server's challenge and check its own proof; returns its data address and tag id.

    Raises AuthenticationError when the server refuses this side's token or cannot
    prove its own; PeerDisconnectedError or TransferTimeoutError (retryable) when
    it closes or stalls."""
    return answer_challenge(
        sock,
        peer=peer,
        token=token,
        address=address,
        inbound_id=inbound_id,
        deadline=HandshakeDeadline(timeout_s, f"handshake with {peer}"),
    )


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
