"""torch.distributed gloo backend: the baseline of the benchmarks and a fallback
where UCX is unavailable. Each connection is a two-rank gloo group (acceptor is
rank 0) formed after the token handshake, through a TCPStore whose listening
socket this module binds itself (torch's own would bind every interface); the
group holds the store, so that socket lives as long as the connection. Neither
it nor gloo's own sockets check the job token: their addresses are only ever
told over the authenticated channel, and they bind the configured host
(loopback by default). Prefer UCX where it is available."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from replica.timing import Deadline
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import ControlledConnection, ControlledTransport, EndpointConfig, parse_address

__all__ = ["GlooConfig", "GlooConnection", "GlooTransport"]

logger = logging.getLogger(__name__)

# The least time the handshake's store waits and barrier get, also once its deadline passed.
_LEAST_WAIT = timedelta(milliseconds=1)

#: gloo tags are 32-bit signed; two per replica tag (header, payload).
MAX_GLOO_TAG = (1 << 30) - 1


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class GlooConfig(EndpointConfig):
    # gloo's own timeout for an operation; replica's deadlines are usually shorter.
    op_timeout: timedelta = timedelta(seconds=300)


class _Works:
    """gloo's send/recv works finish only inside ``wait()``, so a thread waits."""

    def __init__(self, works, keep):
        self._keep = keep
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._wait, args=(works,), name="replica-gloo-wait", daemon=True).start()

    def _wait(self, works) -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter in poll()
            self._error = exc
        self._done.set()

    def poll(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        self._keep = None
        return True


class GlooConnection(ControlledConnection):
    def __init__(self, *, group, peer_rank: int, **kwargs):
        super().__init__(memory=GlooTransport.capabilities.memory, **kwargs)
        self._group = group
        self._peer_rank = peer_rank

    def _guard(self, buf, tag, what):
        if tag > MAX_GLOO_TAG:
            raise ValueError(f"the gloo transport takes tags up to {MAX_GLOO_TAG}, got {tag}")
        return super()._guard(buf, tag, what)

    def _isend(self, flat, tag, header, ready):  # host memory only: ready is None
        payload = self._group.send([flat], self._peer_rank, 2 * tag)
        head = torch.frombuffer(bytearray(header()), dtype=torch.uint8)
        return _Works([payload, self._group.send([head], self._peer_rank, 2 * tag + 1)], (flat, head))

    def _irecv(self, flat, tag, header_buf, ready):
        works = [
            self._group.recv([header_buf], self._peer_rank, 2 * tag + 1),
            self._group.recv([flat], self._peer_rank, 2 * tag),
        ]
        return _Works(works, (flat, header_buf))

    def _release(self) -> None:
        # gloo's abort does not unblock an operation in flight; waiters are
        # released by the connection's error, the group lingers until its timeout.
        try:
            self._group.abort()
        except Exception as exc:  # noqa: BLE001
            logger.debug("aborting gloo group to %s: %s", self.peer, exc)


class GlooTransport(ControlledTransport):
    capabilities = Capabilities(memory=MemoryKind.HOST, locality=Locality.SAME_NODE | Locality.REMOTE)

    def __init__(self, config: GlooConfig):
        super().__init__(config)
        self.config = config

    def _offer(self, server, locality):
        if not server:
            return b"", None
        listener = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET)
        listener.bind((self.config.host, 0))
        listener.listen(4)
        host, port = listener.getsockname()[:2]
        return f"{host}:{port}".encode(), listener

    def _discard_offer(self, state):
        if state is not None:
            state.close()

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        # Every wait here is bounded by the handshake's deadline: this may run on
        # the accepting side's handshake thread, and a peer can die at any point.
        end = Deadline.after(timedelta(seconds=timeout_s))

        def left() -> timedelta:
            return max(end.remaining(), _LEAST_WAIT)

        # The ignores: torch.distributed re-exports its stores from torch._C without marking
        # them public, and gloo's _Options and its barrier are missing from torch's stubs.
        tcp_store, prefix_store = dist.TCPStore, dist.PrefixStore  # pyright: ignore[reportPrivateImportUsage]
        if server:
            host, port = state.getsockname()[:2]
            # The store takes the socket and closes it when it dies: detach it
            # so the fd is closed once, never a reused number of someone else's.
            store = tcp_store(
                host, port, 2, True, timeout=left(), wait_for_workers=False, master_listen_fd=state.detach()
            )
        else:
            host, port = parse_address(peer_offer.decode())
            store = tcp_store(host, port, 2, False, timeout=left())
        options = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue] - not in the stub
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.config.host)]
        options._timeout = self.config.op_timeout
        rank = 0 if server else 1
        store = prefix_store("replica", store)
        # gloo's rendezvous waits op_timeout (minutes) for a peer that died after
        # the handshake; meeting in the store first bounds that by the deadline.
        store.set(f"arrived/{rank}", "1")
        store.wait([f"arrived/{1 - rank}"], left())
        group = dist.ProcessGroupGloo(store, rank, 2, options)
        try:
            group.barrier().wait(left())  # pyright: ignore[reportAttributeAccessIssue] - Backend's, not in the stub
        except Exception:
            with contextlib.suppress(Exception):
                group.abort()
            raise
        return GlooConnection(
            transport=self,
            sock=sock,
            peer=peer,
            group=group,
            peer_rank=1 - rank,
            verify=self.config.verify,
            verify_threads=self.config.verify_threads,
        )

    def _shutdown(self) -> None:
        pass
