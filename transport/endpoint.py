"""What every controlled backend is configured with (``EndpointConfig``: token, host,
deadlines, verification), and where a peer is (loopback, this node, elsewhere)."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta

from replica.transport.base import Locality, check_verify_threads

__all__ = ["EndpointConfig", "is_local_address", "keep_alive", "peer_locality"]


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
        if (
            isinstance(self.max_pending_handshakes, bool)
            or not isinstance(self.max_pending_handshakes, int)
            or self.max_pending_handshakes < 1
        ):
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
    for name, value in (
        ("TCP_KEEPIDLE", 1),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", seconds - 1),
        ("TCP_USER_TIMEOUT", seconds * 1000),
    ):
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
