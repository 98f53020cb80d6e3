"""The CUDA IPC backend's host path, which needs no GPU: small host messages (the
mirror protocol's layouts, BEGIN, REPLY) ride its control socket, matched by tag
like device buckets. The contract runs on it with host buffers; device buckets
are in tests/test_transport_gpu.py."""

import pytest
import torch

from replica.errors import TransportError
from replica.transport.base import PIECE_BYTES
from replica.transport.ipc import MAX_HOST_BYTES, IpcConfig, IpcTransport
from support.children import spawn
from support.transport_contract import (
    CHECKS,
    MiB,
    T,
    check_peer_killed_mid_transfer,
    check_round_trip_sizes,
    connected,
    messages_of_a_bucket,
    peer_main,
    run_transport_contract,
)


def make_ipc(token: bytes) -> IpcTransport:
    return IpcTransport(IpcConfig(token=token))


# Killing a peer mid-transfer needs a transfer that lasts: 512 MiB, over the host limit.
HOST_CHECKS = [c for c in CHECKS if c not in (check_peer_killed_mid_transfer, check_round_trip_sizes)]


@pytest.mark.parametrize("check", HOST_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_ipc_host_messages(check):
    run_transport_contract(make_ipc, check)


def test_round_trip_sizes_up_to_the_host_limit():
    # 0 bytes, one frame, several frames (1 MiB each), and the limit itself.
    sizes = (0, 1, 4097, MiB - 100, MiB + 3, 5 * MiB + 7, MAX_HOST_BYTES)
    run_transport_contract(make_ipc, lambda make, device: check_round_trip_sizes(make, sizes=sizes, device=device))


def test_host_message_over_the_limit_is_refused_clearly():
    with make_ipc(b"job-token") as transport, spawn(peer_main, make_ipc, b"job-token") as peer:
        conn = connected(transport, peer)
        with pytest.raises(TransportError, match=f"limit of {MAX_HOST_BYTES} bytes"):
            conn.isend(torch.zeros(MAX_HOST_BYTES + 1, dtype=torch.uint8), tag=1)
        assert conn.alive  # refused before anything was sent
        peer.send("echo", [8], 2)
        back = torch.zeros(8, dtype=torch.uint8)
        receive = conn.irecv(back, tag=3)
        conn.send(torch.arange(8, dtype=torch.uint8), tag=2, timeout=T)
        receive.wait(T)
        assert torch.equal(back, torch.arange(8, dtype=torch.uint8)) and peer.recv() == ("ok",)


def test_capabilities_still_say_cuda_only():
    # Bulk host memory belongs on UCX: a host mirror must never choose IPC.
    from replica.transport import Locality, MemoryKind

    assert not IpcTransport.capabilities.supports(MemoryKind.HOST, Locality.SAME_NODE)
    assert IpcTransport.capabilities.supports(MemoryKind.CUDA, Locality.SAME_NODE)


def test_a_bucket_goes_as_one_message():
    """CUDA IPC sends a bucket whole, whatever its size: each message costs control-socket
    round trips and thread hand-offs, and its receiver hashes on the GPU, so pieces would
    only multiply them. A bucket of three pieces' size arrives verified from one send."""
    n = 2 * PIECE_BYTES + 4099
    assert messages_of_a_bucket(make_ipc, n) == [n]
