"""The shared-memory backend (``ShmTransport``): host buckets between processes of
one node with one copy, the digest taken by that copy. The contract runs on it
with real spawned peers; the checks below add what only it does: buckets in
shared memory go where they lie, others through a staging region, a dead
sender's region stays readable, and a peer that cannot map this side's memory
is refused at the handshake with the reason."""

import contextlib
import fcntl
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch

from replica.errors import PeerDisconnectedError, SharedMemoryUnavailableError, TransportError
from replica.timing import Deadline
from replica.transport import Locality, MemoryKind, memfd
from replica.transport.base import bucket_digest
from replica.transport.ipc import HOST_OFFER_BYTES, MAX_HOST_BYTES, IpcConfig, IpcTransport
from replica.transport.shm import ShmTransport
from support.children import spawn, wait_for
from support.transport_contract import (
    CHECKS,
    SHARED,
    MiB,
    T,
    assert_echoes,
    check_peer_killed_mid_transfer,
    check_round_trip_sizes,
    connected,
    empty,
    pair,
    pattern,
    peer_main,
    run_transport_contract,
)


def make_shm(token: bytes) -> ShmTransport:
    return ShmTransport(IpcConfig(token=token))


# The kill check is its own below: a bucket offered before the kill can still be copied whole.
SHM_CHECKS = [c for c in CHECKS if c is not check_peer_killed_mid_transfer]


@pytest.mark.parametrize("check", SHM_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_shm(check):
    run_transport_contract(make_shm, check)


def make_shm_push(token: bytes) -> ShmTransport:
    return ShmTransport(IpcConfig(token=token, push_host=True))


# The push protocol without a GPU: the sender copies host buckets into the receiver's
# shared-memory buffers (push_host, for tests), as it copies device buckets on a GPU.
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_shm_push(check):
    run_transport_contract(make_shm_push, check, device=SHARED)


def test_push_goes_into_the_receivers_buffer_and_an_unmapped_one_is_offered():
    """A receive in shared memory is pushed into (whether the receive or the send came
    first), one in private memory is offered and copied by the receiver; small host
    messages on the same tag keep their order; every byte exact."""
    n = 3 * MiB + 5
    with make_shm_push(b"job-token") as transport, spawn(peer_main, make_shm_push, b"job-token", SHARED) as peer:
        conn = connected(transport, peer)
        peer.send("recv_all", [(n, 200), (8, 200), (n, 200), (n, 200)])
        datas = [pattern(n, 1, SHARED), pattern(8, 2), pattern(n, 3, SHARED), pattern(n, 4, SHARED)]
        time.sleep(0.2)  # the peer's receives (and WANTs) are posted: the first pushes find them waiting
        for i, data in enumerate(datas):
            conn.send(data, tag=200, timeout=T, bucket=i)
        status, buckets, sums = peer.recv()
        assert status == "ok" and buckets == [0, 1, 2, 3] and sums == [int(d.sum()) for d in datas]
        assert conn.pushed_sends == 3 and conn.num_dest_imports == 1 * 3  # three receive buffers, one each
        assert conn.num_exports == 0  # nothing offered
        # Sends first, receives after: the sends wait for the receives' WANTs.
        sends = [conn.isend(d, tag=201, bucket=i) for i, d in enumerate(datas)]
        peer.send("recv_all", [(n, 201), (8, 201), (n, 201), (n, 201)])
        for s in sends:
            s.wait(T)
        assert peer.recv()[2] == [int(d.sum()) for d in datas] and conn.pushed_sends == 6
        # A receive into private memory: offered (the peer copies it), not pushed.
        back = empty(n, "cpu", fill=0)
        receive = conn.irecv(back, tag=203)
        peer.send("echo", [n], 202)
        conn.send(datas[0], tag=202, timeout=T)
        receive.wait(T)
        assert torch.equal(back, datas[0]) and peer.recv() == ("ok",)
        assert conn.pushed_sends == 7  # the echo's way out was pushed; its way back was offered
        assert conn.num_exports == 0, "the peer's echo was offered by it, not by this side"


def test_push_into_fresh_buffers_releases_the_old_ones():
    """A receiver that takes each bucket into a new buffer (the old one freed) makes the
    sender drop its mapping of the old one: destinations stay bounded, none stale."""
    n, count = HOST_OFFER_BYTES * 4, 40
    with make_shm_push(b"job-token") as transport, spawn(peer_main, make_shm_push, b"job-token", SHARED) as peer:
        conn = connected(transport, peer)
        peer.send("recv_fresh", n, 210, count)
        for i in range(count):
            conn.send(torch.full((n,), i % 251, dtype=torch.uint8), tag=210, timeout=T)
            assert conn.num_dest_imports <= 3, "mappings of the peer's freed buffers were kept"
        status, stats, dest_exports = peer.recv()
        assert status == "ok" and stats == [(i % 251, i % 251) for i in range(count)]
        assert dest_exports <= 2 and conn.pushed_sends == count


def test_round_trip_sizes_across_the_offer_threshold_and_past_the_socket_limit():
    sizes = (HOST_OFFER_BYTES - 1, HOST_OFFER_BYTES, HOST_OFFER_BYTES + 3, MAX_HOST_BYTES + 8 * MiB + 5)
    run_transport_contract(make_shm, lambda make, device: check_round_trip_sizes(make, sizes=sizes, device=device))


def test_capabilities_say_host_and_cuda_on_this_node():
    assert ShmTransport.capabilities.supports(MemoryKind.HOST, Locality.SAME_NODE)
    assert ShmTransport.capabilities.supports(MemoryKind.CUDA, Locality.SAME_NODE)
    assert not ShmTransport.capabilities.supports(MemoryKind.HOST, Locality.REMOTE)
    assert not IpcTransport.capabilities.supports(MemoryKind.HOST, Locality.SAME_NODE)


def test_shared_buffers_go_where_they_lie_others_are_staged():
    """A bucket in ``memfd.shared_empty`` memory is offered in place (no staging copy);
    any other host bucket is copied into a staging region first, which the next send
    reuses. Both arrive exact with the digest of the whole, offset-keyed."""
    n = 3 * MiB + 8
    with make_shm(b"job-token") as transport, spawn(peer_main, make_shm, b"job-token") as peer:
        conn = connected(transport, peer)
        shared = memfd.shared_empty(2 * n)
        shared[n:].copy_(pattern(n, 11))
        peer.send("recv_verify", n, 70)
        sent = conn.send(shared[n:], tag=70, timeout=T, offset=8 * 1000)
        assert peer.recv() == ("ok", int(shared[n:].sum()), 8 * 1000, n, sent.digest)
        assert conn.staged_sends == 0
        for seed in (12, 13):
            data = pattern(n, seed)
            peer.send("recv_verify", n, 71)
            sent = conn.send(data, tag=71, timeout=T)
            assert peer.recv() == ("ok", int(data.sum()), 0, n, sent.digest)
        assert conn.staged_sends == 2
        assert len(conn._staging) == 1, "the second staged send did not reuse the first one's region"
        assert conn.num_exports == 2  # the shared buffer and the one staging region


def test_the_receiver_takes_the_digest_in_its_copy():
    """The receiving side's verification is the copy itself: the receive carries the
    digest its copy took (equal to a separate hash of the bytes), and a bucket that
    changed after its digest was taken is still refused."""
    n = 2 * MiB + 16
    with make_shm(b"job-token") as transport, spawn(peer_main, make_shm, b"job-token") as peer:
        conn = connected(transport, peer)
        buf = empty(n, "cpu", fill=0)
        receive = conn.irecv(buf, tag=72)
        peer.send("send", n, 72, 5)
        assert peer.recv() == ("posted",)
        header = receive.wait(T)
        assert peer.recv() == ("ok",)
        assert torch.equal(buf, pattern(n, 5))
        taken = receive._pieces[0].pending.digest
        assert taken is not None, "the receive hashed in a separate pass"
        assert taken == header.digest == bucket_digest(buf, offset=header.offset)


def test_a_killed_senders_bucket_copies_out_whole_or_fails_cleanly():
    """The sender is killed right after it offered 512 MiB: its region outlives it in
    this process's mapping, so the receive either completes with the exact bytes
    (verified by the digest its copy took) or fails with PeerDisconnectedError; it
    never delivers anything else, the death is seen within 2 s, and the transport
    keeps serving new peers."""
    nbytes = 512 * MiB
    with make_shm(b"job-token") as transport, spawn(peer_main, make_shm, b"job-token") as peer:
        conn = connected(transport, peer)
        buf = empty(nbytes, "cpu", fill=0)
        receive = conn.irecv(buf, tag=30)
        peer.send("send", nbytes, 30, 1)
        assert peer.recv(120) == ("posted",)
        peer.kill()
        killed = Deadline.now()
        assert peer.process.exitcode == -9, "the peer was not killed"
        try:
            receive.wait(timedelta(seconds=30))
        except PeerDisconnectedError:
            delivered = False
        else:
            delivered = True
        deadline = killed + timedelta(seconds=10)
        while conn.alive and not deadline.expired:
            time.sleep(0.01)
        noticed = time.monotonic() - killed.at
        print(f"delivered after the kill: {delivered}; noticed after {noticed:.2f} s")
        assert not conn.alive and noticed < 2.0, f"survivor took {noticed:.2f} s to notice the dead peer"
        if delivered:  # checked after the timing: making the pattern takes seconds on a loaded machine
            assert torch.equal(buf, pattern(nbytes, 1)), "a receive from a killed peer delivered wrong bytes"
        with spawn(peer_main, make_shm, b"job-token") as fresh:
            assert_echoes(connected(transport, fresh), fresh)


@contextlib.contextmanager
def foreign_memfd(name: str, seals: int = 0):
    """The record of a 4 KiB memfd that ``memfd.shared_empty`` did not make: ``name``d so,
    sealed with ``seals``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        yield memfd._RECORD.pack(os.getpid(), fd, os.fstat(fd).st_ino, 4096)
    finally:
        os.close(fd)


def test_an_unsealed_region_is_refused():
    """A region the peer could shrink under the reader (SIGBUS) is never mapped."""
    # named as ours, but not sealed
    with foreign_memfd("replica-shm") as record, pytest.raises(TransportError, match="not sealed"):
        memfd.map_region(record)


def test_a_record_of_another_file_is_refused():
    held = memfd.shared_empty(4096)
    region = memfd.region_of(held)
    assert region is not None and memfd.map_region(region.record).numel() == 4096
    pid, fd, inode, size = memfd._RECORD.unpack(region.record)
    with pytest.raises(TransportError, match="not the peer's shared memory"):
        memfd.map_region(memfd._RECORD.pack(pid, fd, inode + 1, size))
    with pytest.raises(TransportError, match="same PID namespace"):
        memfd.map_region(memfd._RECORD.pack(pid, 1 << 20, inode, size))


_NAMESPACED_PEER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from replica.errors import TransportError
    from replica.transport.ipc import IpcConfig
    from replica.transport.shm import ShmTransport
    with ShmTransport(IpcConfig(token=b"job-token")) as transport:
        try:
            transport.connect(sys.argv[1], timedelta(seconds=30))
        except TransportError as exc:
            print(f"refused: {type(exc).__name__}: {exc}")
        else:
            print("connected")
""")


@pytest.mark.parametrize("mount_proc", [True, False], ids=["own_proc", "shared_proc"])
def test_a_peer_in_another_pid_namespace_is_refused_with_the_reason(caplog, pid_namespace, mount_proc):
    """Two processes of one node that cannot map each other's memory (here: the peer in
    a PID namespace of its own, as in another container) get no connection, and both
    sides say why, instead of failing at the first bucket. Where only one side cannot
    map the other's (``shared_proc``), the handshake's verdicts tell the other, so the
    connector still gets the typed refusal a fallback is chosen on."""
    command = pid_namespace(mount_proc)
    with make_shm(b"job-token") as transport:
        address = transport.listen()
        out = subprocess.run(
            [*command, sys.executable, "-c", _NAMESPACED_PEER, address], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("refused: SharedMemoryUnavailableError:"), out.stdout
        assert "cannot share host memory" in out.stdout, out.stdout
        if not mount_proc:  # the peer mapped this side's probe: it was told this side could not map its
            assert "it could not map this side's region" in out.stdout, out.stdout
        with pytest.raises(TransportError):
            transport.accept(timedelta(seconds=1))
    assert any("cannot share host memory" in r.getMessage() for r in caplog.records)


def test_a_peer_of_another_backend_is_refused_at_once(caplog):
    """A CUDA IPC peer offers no region and sends no verdict: the shm side refuses it at once,
    saying why, instead of waiting out its handshake for a verdict that never comes."""
    with (
        ShmTransport(IpcConfig(token=b"job-token", handshake_timeout=timedelta(seconds=60))) as server,
        IpcTransport(IpcConfig(token=b"job-token")) as client,
    ):
        conn = client.connect(server.listen(), timedelta(seconds=30))
        wait_for(lambda: not conn.alive, "the shm side to refuse the IPC peer", timeout_s=10)
        assert any("not a shared-memory peer" in r.getMessage() for r in caplog.records)
        with pytest.raises(TransportError):
            server.accept(timedelta(seconds=0.5))


@pytest.mark.parametrize("failing", ["connector", "listener"])
def test_a_side_that_cannot_make_shared_memory_is_refused_with_the_typed_error(monkeypatch, caplog, failing):
    """Out of memfds (descriptors used up, a seccomp filter) on either side: the connection
    is refused with SharedMemoryUnavailableError at the connector, the error a fallback is
    taken on, instead of a failed handshake."""
    import errno
    import threading

    real = memfd.shared_empty
    listener_side = failing == "listener"

    def no_memfd(nbytes):  # the listener's handshakes run on threads of their own
        if threading.current_thread().name.startswith("replica-handshake") == listener_side:
            raise OSError(errno.EMFILE, "Too many open files (injected)")
        return real(nbytes)

    monkeypatch.setattr(memfd, "shared_empty", no_memfd)
    with make_shm(b"job-token") as server, make_shm(b"job-token") as client:
        address = server.listen()
        with pytest.raises(SharedMemoryUnavailableError, match="could not make" if listener_side else "injected"):
            client.connect(address, timedelta(seconds=30))
        with pytest.raises(TransportError):
            server.accept(timedelta(seconds=0.5))
    if listener_side:
        assert any("cannot make shared memory" in r.getMessage() for r in caplog.records)


def test_a_region_closes_its_file_when_its_tensor_is_freed():
    held = memfd.shared_empty(8192)
    pid, fd, _, _ = memfd._RECORD.unpack(memfd.region_of(held[100:]).record)
    assert memfd.region_of(held[100:]).offset == 100
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:replica-shm")
    view = held[10:20]
    del held
    gc.collect()
    assert memfd.region_of(view) is not None  # a view keeps its region
    del view
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or not os.readlink(f"/proc/self/fd/{fd}").startswith(
        "/memfd:replica-shm"
    )
    assert memfd.region_of(torch.zeros(10, dtype=torch.uint8)) is None


def test_only_replica_regions_are_mapped():
    """A record naming any other file descriptor (here: a sealed memfd of another name, as
    other programs make) is refused before anything is mapped."""
    with (
        foreign_memfd("someone-else", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) as record,
        pytest.raises(TransportError, match="not a replica shared-memory region"),
    ):
        memfd.map_region(record)


def test_an_offer_of_another_processs_region_is_refused():
    """A connection maps only regions of the process its handshake proved: an offer naming
    a region of any other process (here: this one's own, as a peer that knows its fds
    could try) is a protocol error, and nothing is mapped."""
    from replica.transport import ipc_frames

    held = memfd.shared_empty(HOST_OFFER_BYTES)
    record = memfd.region_of(held).record
    with make_shm(b"job-token") as transport, spawn(peer_main, make_shm, b"job-token") as peer:
        conn = connected(transport, peer)
        assert conn._peer_pid == peer.pid != os.getpid()
        offer = (
            ipc_frames.OFFER_FIXED.pack(9, 0, 0, 77, 0, HOST_OFFER_BYTES, True)
            + bytes(64)
            + ipc_frames.HOST_EXPORT
            + record
        )
        with pytest.raises(TransportError, match="another process made"):
            conn._on_control(ipc_frames.OFFER, offer)
        assert conn.num_imports == 0
        # Nor is such a region taken as a receive's buffer to push into.
        want = ipc_frames.WANT_FIXED.pack(9, 0, 78, 0, HOST_OFFER_BYTES, True) + ipc_frames.HOST_EXPORT + record
        with pytest.raises(TransportError, match="another process made"):
            conn._on_control(ipc_frames.WANT, want)
        assert conn.num_dest_imports == 0


def test_a_receive_finished_before_its_want_keeps_the_export_the_want_names(monkeypatch):
    """The message may finish a receive (on the monitor thread) while the receiving thread is
    still building its WANT: that export has nothing in flight any more, but the WANT names
    it, so it must not be retired (released) in the same breath. Forced here by holding
    the WANT until the sender's offer was copied and acknowledged."""
    n = 2 * HOST_OFFER_BYTES
    with make_shm(b"job-token") as a, make_shm(b"job-token") as b:
        sending, receiving = pair(a, b)
        buffer = memfd.shared_empty(n)  # the receive's buffer: a destination the peer may map
        acknowledged = threading.Event()
        held = []
        retire = type(receiving)._retire_exports

        def held_retire(self, table, using, **kw):
            if table is self._dest_exports and not held:
                held.append(True)
                assert acknowledged.wait(30), "the sender's offer was never acknowledged"
            return retire(self, table, using, **kw)

        monkeypatch.setattr(type(receiving), "_retire_exports", held_retire)
        transfers = []
        poster = threading.Thread(target=lambda: transfers.append(receiving.irecv(buffer, tag=3)))
        poster.start()
        wait_for(lambda: held, "the receive's WANT being built")
        data = pattern(n, 7)
        sending.send(data, tag=3, timeout=T)  # offered, copied by the receiver, acknowledged
        acknowledged.set()
        poster.join(30)
        transfers[0].wait(T)
        assert torch.equal(buffer, data)
        # The connection lives on: the same buffer is received into again (its export named
        # by WANTs the sender must know), and the export the finished receive left is idle.
        for i in range(3):
            transfer = receiving.irecv(buffer, tag=3)
            sending.send(pattern(n, 8 + i), tag=3, timeout=T)
            transfer.wait(T)
            assert torch.equal(buffer, pattern(n, 8 + i))
        assert receiving.num_dest_exports == 1
        wait_for(lambda: sending.num_dest_imports == 1, "the sender holding the receive's export")
