"""CUDA IPC backend: processes of one node, device buckets moved GPU to GPU.

A CUDA bucket is complete once its ``ready`` event has (``Connection.isend``'s
``after``: an event the producer recorded, or the caller's current stream at the
call); an offered one goes out as an OFFER frame over the control socket once it has. The first
offer of a storage carries its export (torch's IPC handle, once per storage and
connection); later ones name the export by id. The receiver maps an export
once, and copies device to device into the caller's buffer, on a copy stream
that first waits for the work the caller had queued on the buffer before
``irecv``. The copy is issued by whichever thread completes the match (the
control monitor thread when the offer arrives, the caller's when the offer was
there first), and a per-transport completion thread acknowledges it once it
has run: neither side has to poll for the other to make progress.

The sender waits for its bucket's producers on the host before offering it, so
the receiver never waits on an event of another process: a producer killed
with its work queued cannot leave the receiver's copy stream blocked forever.
An export names its GPU by UUID; the receiver opens it on the receiving
buffer's GPU (with peer access if that is another one) or explains why not.
An export is released (RELEASE frame, then unmapped behind the copies from it)
once its storage is freed or, past MAX_EXPORTS, least recently used, never
while a send of it is in flight.

**A device bucket is pushed, not pulled, wherever the receiver's buffer can be
mapped here** (device memory, or a shared-memory region on ``ShmTransport``): each
receive announces its buffer (a WANT frame, with an export of its storage, once per
storage and connection), and the sender copies its bucket into it from its own
process, on a copy stream of its own (``cudaMemcpyAsync``: the copy engines) that
waits for the bucket's ``ready`` event alone, then says so (PUSHED). The receiver's
process does no GPU work at all: two processes on one GPU are time-sliced between
their contexts, so a copy the receiver issued would wait for the sender's kernels
(a trainer's next step), and a receiver on host memory would need a GPU to copy from
one. Into device memory the sender also takes the digest of the bytes where they
landed (one hash kernel, on the same stream); into host memory the receiver hashes
them on its CPU threads. A receive whose buffer cannot be mapped (plain host memory)
announces none, and the sender offers the bucket as before.

Small host messages (the mirror protocol's layouts, BEGIN, REPLY, FETCH) ride
the control socket itself, in order with the offers and matched by the same
tags, so one IPC connection carries a whole mirror session. On ``IpcTransport``
host payloads are bounded (``MAX_HOST_BYTES``) and its capabilities say CUDA
only.

``ShmTransport`` moves bulk host memory too, with one copy: a host bucket of
``HOST_OFFER_BYTES`` or more is offered like a device bucket, as a memfd region
(``replica.transport.memfd``) the receiver maps and copies out of, the bucket's
digest taken by that same copy (``ops.pack_checksum``), then acknowledged. A
bucket already in a region (``memfd.shared_empty``: the mirror's snapshots) is
offered where it lies; any other is first copied into a staging region of the
connection. Both sides prove at the handshake that they can map each other's
regions (same user, same PID namespace), or the connection is refused, saying so.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from replica.errors import TransportError
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import ControlledConnection, ControlledTransport, EndpointConfig
from replica.transport.ipc_cuda import EventThread
from replica.transport.ipc_frames import HOST_OFFER_BYTES, MAX_EXPORTS, MAX_HOST_BYTES, MAX_STAGED_BYTES
from replica.transport.ipc_recv import Receiving
from replica.transport.ipc_send import Sending

__all__ = [
    "HOST_OFFER_BYTES",
    "IpcConfig",
    "IpcConnection",
    "IpcTransport",
    "MAX_EXPORTS",
    "MAX_HOST_BYTES",
    "MAX_STAGED_BYTES",
]


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class IpcConfig(EndpointConfig):
    #: Device buckets are copied into the receiver's buffer by the sender's process
    #: (see the module docstring); False: the receiver copies every bucket itself.
    #: Both sides follow the sender's setting.
    push: bool = True
    #: Tests only: bulk host buckets are pushed too (a CPU copy by the sender), so the
    #: push protocol runs on a machine without a GPU. Slower than the receiver's copy
    #: with its digest in the same pass, which host buckets otherwise take.
    push_host: bool = False


class IpcConnection(Sending, Receiving, ControlledConnection):
    # One message per bucket: every message costs an offer (or a WANT and a PUSHED), a
    # copy and a frame back through the control socket and a few threads: pieces
    # would only multiply the messages (a mirror stream of 64 MiB buckets moved 50.9
    # GB/s on an H200 in 16 MiB pieces).
    piece_bytes = None

    def __init__(
        self,
        *,
        host_offers: bool = False,
        probe: torch.Tensor | None = None,
        peer_pid: int | None = None,
        push: bool = True,
        push_host: bool = False,
        **kwargs,
    ):
        # HOST too: small control messages ride the control socket (see the module docstring).
        super().__init__(memory=MemoryKind.HOST | MemoryKind.CUDA, **kwargs)
        # The state both halves share, declared with its types in IpcState (replica.transport.ipc_cuda):
        self._host_offers = host_offers  # ShmTransport: bulk host buckets go as shared memory
        self._peer_pid = peer_pid  # whose regions alone are mapped: the process the handshake's probe proved
        self._probe = probe  # this side's handshake region, mapped by the peer: kept while connected
        self._push = push  # device buckets go into the receiver's buffer when it can be mapped here
        self._push_host = push_host  # tests only: bulk host buckets too (see IpcConfig.push_host)
        self._staging = []  # free staging regions, least recently freed first
        self._staging_lock = threading.Lock()
        self.staged_sends = 0  # host sends that were copied into a staging region first
        self.pushed_sends = 0  # sends copied into the receiver's buffer by this side
        self._push_failure = None  # why a push failed here once: the rest are offered
        self._seq = itertools.count()
        self._export_ids = itertools.count(1)
        # Lock order: _out_lock, then _state_lock; the monitor thread takes only
        # _state_lock, and no lock but _out_lock is held while a frame is written.
        self._out_lock = threading.Lock()
        self._outbox = collections.deque()
        self._state_lock = threading.Lock()
        self._sends = {}
        # This side's storages the peer may map, by (storage, address, size): those
        # sent from (offers), and those received into (destinations of WANTs).
        self._exports = collections.OrderedDict()
        self._dest_exports = collections.OrderedDict()
        # Messages by (tag, index): receives posted, and messages that came before theirs.
        self._sent = collections.defaultdict(int)
        self._received = collections.defaultdict(int)
        self._waiting = {}
        self._unmatched = {}
        # The peer's receives not yet matched by a send here, and sends waiting for the peer's receive.
        self._wants = {}
        self._pushes = {}
        # The peer's storages: those it offers (imports), those it receives into (destinations).
        self._imports = {}
        self._destinations = {}
        self._partial = None  # monitor thread only

    # For tests and diagnostics:
    @property
    def num_exports(self) -> int:
        """Storages this side has offered to the peer."""
        return self._count(self._exports)

    @property
    def num_imports(self) -> int:
        """Offered exports of the peer this side holds (mapped or not yet used)."""
        return self._count(self._imports)

    @property
    def num_dest_exports(self) -> int:
        """Storages this side receives into that the peer may map and push into."""
        return self._count(self._dest_exports)

    @property
    def num_dest_imports(self) -> int:
        """The peer's receive buffers this side holds, to push into."""
        return self._count(self._destinations)

    def _count(self, table) -> int:
        with self._state_lock:
            return len(table)

    def _release(self) -> None:
        with self._state_lock:
            pending = list(self._sends.values()) + list(self._waiting.values())
            imports = list(self._imports.values()) + list(self._destinations.values())
            self._sends.clear()
            self._waiting.clear()
            self._unmatched.clear()
            self._wants.clear()
            self._pushes.clear()
            self._imports.clear()
            self._destinations.clear()
            self._exports.clear()
            self._dest_exports.clear()
        with self._staging_lock:
            self._staging.clear()
        self._outbox.clear()  # without _out_lock: a writer holding it may be what failed
        for p in pending:
            p.completion.set()  # waiters see the connection's error
        for source in imports:
            # Queued behind the copies still running from it: never unmapped under a copy.
            self._transport._copied.submit(None, source.unmap)


class IpcTransport(ControlledTransport):
    """CUDA IPC between processes of one node. Its capabilities say CUDA only:
    host messages travel too, but only up to MAX_HOST_BYTES (over the control
    socket), so a host mirror must choose another backend.

    One ready thread, one pusher thread and one completion thread per transport
    serve all its connections, in order: an offer whose producers are still
    running delays the offers queued after it, on every connection of this
    transport (a push waits for its producers on its copy stream, not here)."""

    capabilities = Capabilities(memory=MemoryKind.CUDA, locality=Locality.SAME_NODE)

    def __init__(self, config: IpcConfig):
        super().__init__(config)
        self.config = config
        # Offers wait for their buckets' producers here; pushes are mapped and issued
        # here; receives' copies and pushes are finished here.
        self._ready = EventThread("replica-ipc-ready")
        self._pusher = EventThread("replica-ipc-push")
        self._copied = EventThread("replica-ipc-copied")

    def _offer(self, server, locality):
        if locality is not Locality.SAME_NODE:
            raise TransportError(
                "CUDA IPC reaches processes on this host only; the peer is on another (use the UCX transport)"
            )
        return b"", None

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        return IpcConnection(
            transport=self,
            sock=sock,
            peer=peer,
            verify=self.config.verify,
            verify_threads=self.config.verify_threads,
            push=self.config.push,
            push_host=self.config.push_host,
            **self._host_path(peer, peer_offer, state),
        )

    def _host_path(self, peer: str, peer_offer: bytes, state: Any) -> dict[str, Any]:
        """What the connection needs for host buckets beyond the control socket: none here."""
        return {}

    def _shutdown(self) -> None:
        self._ready.close()
        self._pusher.close()
        self._copied.close()  # after the connections queued their unmaps
