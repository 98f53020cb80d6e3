"""UCX backend (UCXX): a TCP control channel for the handshake and liveness,
and a UCX data endpoint made from the peer's worker address.

The data endpoint runs without UCX endpoint error handling by default: with it
UCX restricts itself to tcp (~1 GB/s here), without it UCX may use shared
memory (posix/sysv, ~10 GB/s here) on one node and RDMA or cuda_ipc where present.
Such an endpoint never notices a dead peer by itself; the control socket does,
within milliseconds, and a deadline on every wait catches a frozen one.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from dataclasses import dataclass

import numpy as np
import torch

from replica.errors import PeerDisconnectedError, TransportError
from replica.transport.base import Capabilities, Connection, Locality, MemoryKind, Transport
from replica.transport.control import (
    BYE,
    ControlMonitor,
    ControlServer,
    client_handshake,
    parse_address,
    server_handshake,
)

__all__ = ["UcxConfig", "UcxConnection", "UcxTransport"]

logger = logging.getLogger(__name__)

_KIND_PAYLOAD = 0
_KIND_HEADER = 1
_MAX_CONNECTIONS = (1 << 16) - 1


@dataclass(kw_only=True, frozen=True, slots=True)
class UcxConfig:
    """Settings of one process's UCX transport. UCX options go to this
    transport's context only; nothing is read from or written to the environment."""

    token: bytes
    host: str = "127.0.0.1"
    port: int = 0
    # UCX_TLS for this context. Without endpoint error handling a failed
    # process_vm_readv is fatal in UCX's cma transport: a peer killed mid-transfer
    # would abort this process. The shared-memory FIFOs (posix, sysv) have no
    # such call on the peer and measured faster here (~10 vs ~5.5 GB/s).
    ucx_transports: str = "^cma,knem,xpmem"
    data_error_handling: bool = False
    verify: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or not self.token:
            raise ValueError("token must be non-empty bytes (the job's secret)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def __repr__(self) -> str:  # never print the token
        return (f"UcxConfig(host={self.host!r}, port={self.port}, ucx_transports={self.ucx_transports!r}, "
                f"data_error_handling={self.data_error_handling}, verify={self.verify})")


def _ucx():
    import ucxx._lib.libucxx as ucx  # imported late: it loads libucx

    return ucx


def _array(flat: torch.Tensor):
    from ucxx._lib.arr import Array

    # Zero-copy: numpy view of host memory, __cuda_array_interface__ for CUDA.
    return Array(flat.numpy() if flat.device.type == "cpu" else flat)


class _Requests:
    def __init__(self, requests, keep):
        self._requests = requests
        self._keep = keep  # buffers UCX reads or writes until the requests finish

    def poll(self) -> bool:
        for r in self._requests:
            if not r.completed:
                return False
        for r in self._requests:
            r.check_error()
        self._keep = None
        return True


class UcxConnection(Connection):
    def __init__(self, *, transport: UcxTransport, sock: socket.socket, peer: str, endpoint,
                 send_id: int, recv_id: int, verify: bool):
        super().__init__(peer=peer, memory=UcxTransport.capabilities.memory, verify=verify)
        self._transport = transport
        self._sock = sock
        self._endpoint = endpoint
        self._send_id = send_id
        self._recv_id = recv_id

    def _tag(self, conn_id: int, tag: int, kind: int):
        return _ucx().UCXXTag((conn_id << 48) | (tag << 8) | kind)

    def _isend(self, flat, tag, header):
        ep = self._endpoint
        payload = ep.tag_send(_array(flat), tag=self._tag(self._send_id, tag, _KIND_PAYLOAD))
        header_arr = np.frombuffer(header(), dtype=np.uint8).copy()
        head = ep.tag_send(_array(torch.from_numpy(header_arr)), tag=self._tag(self._send_id, tag, _KIND_HEADER))
        return _Requests([payload, head], (header_arr, flat))

    def _irecv(self, flat, tag, header_buf):
        ep = self._endpoint
        requests = [
            ep.tag_recv(_array(header_buf), tag=self._tag(self._recv_id, tag, _KIND_HEADER)),
            ep.tag_recv(_array(flat), tag=self._tag(self._recv_id, tag, _KIND_PAYLOAD)),
        ]
        return _Requests(requests, (header_buf, flat))

    def _peer_lost(self, reason: str) -> None:
        self._fail(PeerDisconnectedError(f"{self.peer}: {reason}"))

    def _abort(self) -> None:
        self._transport._forget(self)
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(0.1)
            self._sock.sendall(BYE)
        except OSError:
            pass  # the peer is gone already
        self._sock.close()
        try:
            self._endpoint.close()  # cancels this endpoint's requests in flight
        except Exception as exc:  # noqa: BLE001 - a dead peer's endpoint may refuse to close cleanly
            logger.debug("closing UCX endpoint to %s: %s", self.peer, exc)


class UcxTransport(Transport):
    """One UCX context, worker and progress thread per process; many connections."""

    capabilities = Capabilities(memory=MemoryKind.HOST | MemoryKind.CUDA,
                                locality=Locality.SAME_NODE | Locality.REMOTE)

    def __init__(self, config: UcxConfig):
        ucx = _ucx()
        self.config = config
        options = {"TLS": config.ucx_transports} if config.ucx_transports else {}
        self._context = ucx.UCXContext(config_dict=options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._context)
        # A polling progress thread: the epoll-blocking mode left 512 MiB
        # shared-memory transfers hanging here (UCX 1.21, ucxx 0.52).
        self._worker.start_progress_thread(polling_mode=True)
        self._address = bytes(self._worker.address.tobytes())
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._connections: set[UcxConnection] = set()
        self._monitor = ControlMonitor()
        self._server: ControlServer | None = None
        self._closed = False

    def _listen(self) -> str:
        if self._server is None:
            self._server = ControlServer(self.config.host, self.config.port)
        return self._server.address

    def _accept(self, timeout_s: float) -> Connection:
        if self._server is None:
            raise TransportError("accept() before listen()")
        sock, peer = self._server.accept(timeout_s)
        return self._establish(sock, peer, server_handshake, timeout_s)

    def _connect(self, address: str, timeout_s: float) -> Connection:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerDisconnectedError(f"cannot connect to {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._establish(sock, address, client_handshake, timeout_s)

    def _establish(self, sock, peer, handshake, timeout_s) -> UcxConnection:
        recv_id = self._next_id()
        try:
            peer_address, send_id = handshake(sock, peer=peer, token=self.config.token,
                                              address=self._address, inbound_id=recv_id,
                                              timeout_s=timeout_s)
            endpoint = self._worker.create_endpoint_from_worker_address(
                _ucx().UCXAddress.create_from_buffer(peer_address), self.config.data_error_handling)
        except BaseException:
            sock.close()
            raise
        conn = UcxConnection(transport=self, sock=sock, peer=peer, endpoint=endpoint,
                             send_id=send_id, recv_id=recv_id, verify=self.config.verify)
        if self.config.data_error_handling:
            endpoint.set_close_callback(conn._peer_lost, cb_args=("UCX endpoint closed",))
        with self._lock:
            self._connections.add(conn)
        self._monitor.watch(sock, conn._peer_lost)
        logger.info("connected to %s", peer)
        return conn

    def _next_id(self) -> int:
        conn_id = next(self._ids)
        if conn_id > _MAX_CONNECTIONS:
            raise TransportError(f"more than {_MAX_CONNECTIONS} connections on one transport")
        return conn_id

    def _forget(self, conn: UcxConnection) -> None:
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
        self._worker.stop_progress_thread()
