"""The transport contract on device memory: CUDA IPC, UCX (cuda_ipc / cuda_copy) and NIXL
(its UCX plugin, VRAM registrations);
then what device memory adds: stream ordering against kernels still queued on the
buffer, and CUDA IPC's exports, mappings and host control messages."""

import contextlib
import importlib.util
import time

import pytest
import torch

from replica.errors import TransportError
from replica.transport import memfd
from replica.transport.ipc import HOST_OFFER_BYTES, MAX_EXPORTS, IpcConfig, IpcTransport
from replica.transport.shm import ShmTransport
from replica.transport.ucx import UcxConfig, UcxTransport
from support.children import spawn
from support.transport_contract import (
    CHECKS,
    STALL_CYCLES,
    MiB,
    T,
    check_round_trip_sizes,
    connected,
    empty,
    pattern,
    peer_main,
    run_transport_contract,
)

pytestmark = pytest.mark.gpu

# ~25-50 ms of GPU time: long enough that a transport which does not wait for
# the stream reads (or overwrites) the buffer before the kernel after it ran.
DELAY_CYCLES = 50_000_000


def make_ipc(token: bytes) -> IpcTransport:
    return IpcTransport(IpcConfig(token=token))


def make_ucx(token: bytes) -> UcxTransport:
    return UcxTransport(UcxConfig(token=token))


def make_shm(token: bytes) -> ShmTransport:
    return ShmTransport(IpcConfig(token=token))


def make_nixl(token: bytes):
    from replica.transport.nixl import NixlConfig, NixlTransport

    return NixlTransport(NixlConfig(token=token))


# The GPU machines lent to the project have no package registry: UCX and NIXL run there only
# when their wheels were carried (docs/operations.md, "On a GPU"); without them their cases
# skip, saying so.
_NEEDS_UCXX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
_NEEDS_NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL is not installed")
BACKENDS = pytest.mark.parametrize(
    "make",
    [make_ipc, pytest.param(make_ucx, marks=_NEEDS_UCXX), pytest.param(make_nixl, marks=_NEEDS_NIXL)],
    ids=["ipc", "ucx", "nixl"],
)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@BACKENDS
def test_contract_cuda(make, check):
    run_transport_contract(make, check, device="cuda")


@contextlib.contextmanager
def _behind_a_kernel(side: bool):
    """The block runs with a long kernel queued first on its current stream
    (the caller's, or a side stream): what it queues runs well after it returns."""
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(DELAY_CYCLES)
        yield


@contextlib.contextmanager
def _connected_cuda_peer(make):
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", "cuda") as peer:
        yield peer, connected(transport, peer)


def _zeros(n: int) -> torch.Tensor:
    buf = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # so only the kernels a test queues later are pending
    return buf


SIDE = pytest.mark.parametrize("side", [False, True], ids=["current_stream", "side_stream"])


@SIDE
@BACKENDS
def test_send_right_after_a_kernel_writes_the_buffer(make, side):
    n = 64 * MiB
    with _connected_cuda_peer(make) as (peer, conn):
        buf = _zeros(n)
        for i, value in enumerate((7, 201)):
            peer.send("recv_all", [(n, 100 + i)])
            with _behind_a_kernel(side):
                buf.fill_(value)
                send = conn.isend(buf, tag=100 + i)
            send.wait(T)
            status, _, sums = peer.recv()
            assert status == "ok" and sums == [n * value], f"the receiver saw the buffer before fill {i}"


@SIDE
@BACKENDS
def test_receive_lands_after_work_queued_on_the_buffer(make, side):
    n = 64 * MiB
    with _connected_cuda_peer(make) as (peer, conn):
        back = _zeros(n)
        for i in range(2):
            peer.send("send", n, 110 + i, i)
            assert peer.recv() == ("posted",)
            with _behind_a_kernel(side):
                back.fill_(0xEE)  # queued before irecv: the received bytes must win
                receive = conn.irecv(back, tag=110 + i)
            receive.wait(T)
            # Work queued after the receive completed sees the received bytes.
            assert torch.equal(back, pattern(n, i, "cuda")), f"the pending fill overwrote receive {i}"
            assert peer.recv() == ("ok",)


def test_ipc_many_sends_of_one_storage_stay_bounded():
    # 1200 sends into one receive buffer: pushed, through one mapping of it, not one per
    # send (torch nests a new ref-counter and event per _share_cuda_, and uses stream
    # syncs after 1000 events).
    n, count = MiB, 1200
    with _connected_cuda_peer(make_ipc) as (peer, conn):
        buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        peer.send("recv_stats", n, 120, count)
        for i in range(count):
            buf.fill_(i % 251)
            conn.send(buf, tag=120, timeout=T)
            assert conn.num_dest_imports == 1
        status, stats, num_imports = peer.recv(timeout=120)
        assert status == "ok" and stats == [(i % 251, i % 251) for i in range(count)]
        assert conn.pushed_sends == count and conn.num_exports == 0 and num_imports == 0


def test_ipc_free_and_reallocate_between_sends():
    # Each send's buffer is freed before the next is allocated, so the caching
    # allocator may hand back the same address: pushed from it each time, exact.
    n, count = 4 * MiB, 3 * MAX_EXPORTS
    with _connected_cuda_peer(make_ipc) as (peer, conn):
        peer.send("recv_stats", n, 130, count)
        for i in range(count):
            buf = torch.full((n,), i % 251, dtype=torch.uint8, device="cuda")
            conn.send(buf, tag=130, timeout=T)
            del buf
            assert conn.num_exports == 0 and conn.num_dest_imports == 1
        status, stats, num_imports = peer.recv(timeout=120)
        assert status == "ok" and stats == [(i % 251, i % 251) for i in range(count)]


def test_ipc_receiver_reallocates_between_receives():
    # The receiver takes each bucket into a new buffer, the last one freed first: the
    # caching allocator hands back the same block, exported anew. The sender must drop
    # its mapping of a freed buffer (never push into a stale one) and keep few.
    n, count = 4 * MiB, 3 * MAX_EXPORTS
    with _connected_cuda_peer(make_ipc) as (peer, conn):
        peer.send("recv_fresh", n, 135, count)
        buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        for i in range(count):
            buf.fill_(i % 251)
            conn.send(buf, tag=135, timeout=T)
            assert conn.num_dest_imports <= 3, "mappings of the receiver's freed buffers were kept"
        status, stats, dest_exports = peer.recv(timeout=120)
        assert status == "ok" and stats == [(i % 251, i % 251) for i in range(count)]
        assert dest_exports <= 2 and conn.pushed_sends == count


@BACKENDS
def test_a_send_after_its_event_does_not_wait_for_later_work(make):
    # after=<event>: the bucket is complete at that event; a kernel queued after it on the
    # same stream (the next training step) must not hold the send back.
    n = 64 * MiB
    with _connected_cuda_peer(make) as (peer, conn):
        buf = _zeros(n)
        peer.send("recv_all", [(n, 137)])
        buf.fill_(9)
        filled = torch.cuda.Event()
        filled.record()
        torch.cuda._sleep(STALL_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        conn.send(buf, tag=137, timeout=T, after=filled)
        assert not slept.query(), "the send waited for the kernel queued after its event"
        status, _, sums = peer.recv()
        assert status == "ok" and sums == [n * 9]
        slept.synchronize()


def _pair(receiver, sender):
    status, address = receiver.request("listen")
    assert status == "address"
    assert sender.request("connect", address) == ("ok",)
    assert receiver.recv() == ("ok",)


def test_ipc_exporter_killed_while_mapped():
    # The sender sends from one buffer in a loop; the receiver has that
    # allocation mapped, and copies from it, when the sender is killed. Its
    # receives complete or fail with PeerDisconnectedError, promptly; nothing
    # crashes or hangs. Both sides run in children: a GPU fault would be
    # reported as the receiver's death, not taken into this process.
    n = 64 * MiB
    with spawn(peer_main, make_ipc, b"job-token", "cuda", name="receiver") as receiver:
        with spawn(peer_main, make_ipc, b"job-token", "cuda", name="sender") as sender:
            _pair(receiver, sender)
            sender.send("send_loop", n, 140, 1_000_000)
            receiver.send("recv_until_dead", n, 140, 20)
            assert receiver.recv() == ("received", 20)
            sender.kill()
            killed_at = time.monotonic()
            assert sender.process.exitcode == -9, "the sender was not killed"
            status, received, mixed, alive, num_imports = receiver.recv(timeout=30)
            assert time.monotonic() - killed_at < 5.0, "the receiver took too long to see the sender's death"
            assert status == "ok" and received >= 20 and mixed == 0
            assert not alive and num_imports == 0
        # The receiver's process still works: a new sender, a round trip.
        with spawn(peer_main, make_ipc, b"job-token", "cuda", name="fresh") as fresh:
            _pair(receiver, fresh)
            receiver.send("echo", [MiB], 150)
            fresh.send("send", MiB, 150, 4)
            assert fresh.recv() == ("posted",) and fresh.recv() == ("ok",)
            fresh.send("recv_stats", MiB, 151, 1)
            assert receiver.recv() == ("ok",)
            status, stats, _ = fresh.recv()
            expected = pattern(MiB, 4)
            assert status == "ok" and stats == [(int(expected.min()), int(expected.max()))]


def test_ipc_host_and_device_messages_share_tags_in_order():
    # The mirror protocol's small host messages (layouts, BEGIN, REPLY) travel
    # on the same connection and tags as device buckets, in order; the peer
    # receives each into device memory and echoes it from there.
    sizes = [8, 3 * MiB + 1, 0, 200]
    with _connected_cuda_peer(make_ipc) as (peer, conn):
        peer.send("echo", sizes, 160)
        for i, n in enumerate(sizes):
            device = "cpu" if i % 2 == 0 else "cuda"
            data = pattern(n, i, device)
            back = empty(n, "cuda" if device == "cpu" else "cpu", fill=0xAB)  # the other memory kind
            receive = conn.irecv(back, tag=161)
            conn.send(data, tag=160, timeout=T, step=i)
            assert receive.wait(T).step == i
            assert torch.equal(back.cpu(), data.cpu()), f"message {i} ({n} bytes from {device}) came back different"
        assert peer.recv() == ("ok",)
        with pytest.raises(TransportError, match="limit"):
            conn.isend(torch.zeros(128 * MiB, dtype=torch.uint8), tag=162)
        assert conn.alive


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "staged"])
def test_shm_host_buckets_to_a_cuda_peer_and_back(shared):
    """The shm backend between host memory here and device memory in the peer: a host
    bucket offered as a shared-memory region (or staged into one) lands in the peer's
    GPU buffer, its digest checked there, and the peer's CUDA IPC export lands back in
    host memory here."""
    sizes = (HOST_OFFER_BYTES - 1, HOST_OFFER_BYTES, 3 * MiB + 5, 80 * MiB + 3)
    alloc = memfd.shared_empty if shared else (lambda n: torch.empty(n, dtype=torch.uint8))
    conn = check_round_trip_sizes(make_shm, sizes, "cpu", peer_device="cuda", alloc=alloc)
    assert (conn.staged_sends > 0) != shared
