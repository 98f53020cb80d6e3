"""``ShmTransport``: the CUDA IPC connection that moves bulk host memory too, as shared
memory with one copy (the regions are ``replica.transport.memfd``'s; the protocol is
``replica.transport.ipc``'s docstring)."""

from __future__ import annotations

import logging
import os

import torch

from replica.errors import SharedMemoryUnavailableError, TransportError
from replica.transport import memfd
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import exchange_verdicts
from replica.transport.ipc import IpcConfig, IpcTransport

__all__ = ["IpcConfig", "ShmTransport"]  # IpcConfig: the configuration it takes

logger = logging.getLogger(__name__)

_PROBE_NONCE_BYTES = 16


class ShmTransport(IpcTransport):
    """``IpcTransport`` that moves bulk host memory too, as shared memory with one
    copy (see the module docstring): the backend for host buckets between processes
    of one node that run as the same user in the same PID namespace. Its handshake
    proves that: each side maps a region the other made and checks its bytes, or
    the connection is refused with the reason (then use UCX)."""

    capabilities = Capabilities(memory=MemoryKind.HOST | MemoryKind.CUDA, locality=Locality.SAME_NODE)

    def _offer(self, server, locality):
        super()._offer(server, locality)
        try:
            probe = memfd.shared_empty(_PROBE_NONCE_BYTES)
        except OSError as exc:  # no memfd here (out of descriptors, a seccomp filter)
            if not server:  # refused before anything is sent: the connector takes the fallback
                raise SharedMemoryUnavailableError(f"cannot make shared memory here: {exc}") from exc
            logger.warning("cannot make shared memory for a peer's handshake (%s): refusing it", exc)
            return b"", None  # no region offered: both sides refuse (see _open)
        probe.copy_(torch.frombuffer(bytearray(os.urandom(_PROBE_NONCE_BYTES)), dtype=torch.uint8))
        region = memfd.region_of(probe)
        assert region is not None, "shared_empty's tensors are in a region"
        return region.record + probe.numpy().tobytes(), probe

    def _host_path(self, peer, peer_offer, state):
        return {
            "host_offers": True,
            "probe": state,
            "peer_pid": memfd.parse_record(peer_offer[: memfd.RECORD_BYTES]).pid,
        }

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        # Both sides say whether they could map the other's probe before either uses the
        # connection: a refusal seen on one side only (the peer in a PID namespace nested
        # in this one maps this side's region; this side cannot map its) is then seen by
        # both, and each raises SharedMemoryUnavailableError, which a connector can answer
        # by taking another backend.
        # Neither side sends a verdict where either offered no region: this side could not make
        # its own (a server out of memfds), or the peer is none (or could not make one).
        if state is None:
            raise SharedMemoryUnavailableError(
                f"cannot share host memory with {peer}: this side could not make a shared-memory region"
            )
        if len(peer_offer) != memfd.RECORD_BYTES + _PROBE_NONCE_BYTES:
            raise SharedMemoryUnavailableError(
                f"cannot share host memory with {peer}: it offers no region to map "
                "(it could not make one, or it is not a shared-memory peer)"
            )
        reason = self._check_probe(peer_offer)
        peer_reason = exchange_verdicts(sock, reason, peer=peer, timeout_s=timeout_s)
        if reason or peer_reason:
            raise SharedMemoryUnavailableError(
                f"cannot share host memory with {peer}: "
                + (reason or f"it could not map this side's region ({peer_reason})")
            )
        return super()._open(
            sock=sock,
            peer=peer,
            peer_offer=peer_offer,
            send_id=send_id,
            recv_id=recv_id,
            server=server,
            state=state,
            timeout_s=timeout_s,
        )

    @staticmethod
    def _check_probe(peer_offer: bytes) -> str:
        """Why the peer's probe region cannot be mapped and read back here ("" when it can)."""
        record, nonce = peer_offer[: memfd.RECORD_BYTES], peer_offer[memfd.RECORD_BYTES :]
        try:
            mapped = memfd.map_region(record)
        except TransportError as exc:
            return str(exc)
        if mapped[:_PROBE_NONCE_BYTES].numpy().tobytes() != nonce:
            return "the region it offered does not hold what it said (another PID namespace?); use the UCX transport"
        return ""
