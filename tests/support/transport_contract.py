"""The contract every Transport backend meets, as checks that a backend's test
module runs with ``run_transport_contract(make_transport, check)`` (see
tests/test_transport_ucx.py). The peer is always a real spawned process driven
by commands over a pipe."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from replica.errors import (
    AuthenticationError,
    BucketCorruptedError,
    PeerDisconnectedError,
    TransferTimeoutError,
)
from replica.timing import Deadline
from replica.transport import Connection, Transport, memfd
from replica.transport.base import PIECE_BYTES, bucket_digest
from support.children import Child, process_state, spawn

MiB = 1 << 20
T = timedelta(seconds=60)
# GPU clock cycles of torch.cuda._sleep that hold a stream back for about a
# second or more (H100: ~2 GHz): longer than any check takes to look and kill.
STALL_CYCLES = 4_000_000_000

MakeTransport = Callable[..., Transport]


#: A ``device`` for the checks: host memory in shared-memory regions (``memfd.shared_empty``),
#: which a peer on the shm backend maps, and may push into.
SHARED = "shared"


def pattern(nbytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if device == SHARED:
        return memfd.shared_empty(nbytes).copy_(data)
    return data.to(device)


def empty(nbytes: int, device: str, fill: int | None = None) -> torch.Tensor:
    if device == SHARED:
        buf = memfd.shared_empty(nbytes)
        return buf if fill is None else buf.fill_(fill)
    if fill is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


# --- the peer: a spawned process that obeys commands ---


def peer_main(pipe, make: MakeTransport, token: bytes, device: str = "cpu") -> None:
    transport = make(token)
    conn = None
    while True:
        try:
            cmd, *args = pipe.recv()
        except EOFError:
            break
        if cmd == "connect":
            try:
                conn = transport.connect(args[0], T)
                pipe.send(("ok",))
            except AuthenticationError as exc:
                pipe.send(("AuthenticationError", str(exc)))
        elif cmd == "listen":  # the other side of "connect", for checks between two peers
            pipe.send(("address", transport.listen()))
            conn = transport.accept(T)
            pipe.send(("ok",))
        elif cmd == "echo":  # receive buckets of these sizes on tag t, send each back on tag t + 1
            sizes, tag = args
            for n in sizes:
                buf = empty(n, device)
                header = conn.recv(buf, tag=tag, timeout=T)
                conn.send(buf, tag=tag + 1, timeout=T, step=header.step, bucket=header.bucket)
            pipe.send(("ok",))
        elif cmd == "recv_all":  # post every receive first, then wait: many buckets in flight
            specs = args[0]
            bufs = [empty(n, device) for n, _ in specs]
            transfers = [conn.irecv(b, tag=tag) for b, (_, tag) in zip(bufs, specs, strict=False)]
            headers = [t.wait(T) for t in transfers]
            pipe.send(("ok", [h.bucket for h in headers], [int(b.sum()) for b in bufs]))
        elif cmd == "recv_verify":  # receive one bucket; report a digest failure instead of raising
            n, tag = args
            buf = empty(n, device)
            try:
                header = conn.recv(buf, tag=tag, timeout=T)
                pipe.send(("ok", int(buf.sum()), header.offset, header.nbytes, header.digest))
            except BucketCorruptedError as exc:
                pipe.send(("BucketCorruptedError", exc.bucket, exc.step))
        elif cmd == "send":
            n, tag, seed = args
            data = pattern(n, seed, device)
            transfer = conn.isend(data, tag=tag)
            pipe.send(("posted",))
            transfer.wait(T)
            pipe.send(("ok",))
        elif cmd == "send_stalled":  # a send whose bytes a kernel holds back for seconds
            n, tag, seed = args
            data = pattern(n, seed, device)
            torch.cuda.synchronize()
            torch.cuda._sleep(STALL_CYCLES)
            # Reported before isend: UCX's isend waits for the stream, IPC's offer does.
            pipe.send(("posted",))
            conn.isend(data, tag=tag).wait(T)
            pipe.send(("ok",))
        elif cmd == "send_loop":  # count sends of one buffer, its bytes set to i % 251 before send i
            n, tag, count = args
            data = empty(n, device)
            for i in range(count):
                data.fill_(i % 251)
                conn.send(data, tag=tag, timeout=T)
                if i == 0:
                    pipe.send(("posted",))
            pipe.send(("ok",))
        elif cmd == "recv_until_dead":  # receive until the sender dies; report what was seen
            n, tag, report_after = args
            buf = empty(n, device)
            received = mixed = 0
            try:
                while True:
                    conn.recv(buf, tag=tag, timeout=T)
                    received += 1
                    mixed += int(buf.min()) != int(buf.max())  # bytes of two sends in one buffer
                    if received == report_after:
                        pipe.send(("received", received))
            except PeerDisconnectedError:
                pass
            pipe.send(("ok", received, mixed, conn.alive, getattr(conn, "num_imports", None)))
        elif cmd == "recv_stats":  # count receives into one buffer: (min, max) of each, and what is mapped
            n, tag, count = args
            buf = empty(n, device)
            stats = []
            for _ in range(count):
                conn.recv(buf, tag=tag, timeout=T)
                stats.append((int(buf.min()), int(buf.max())) if n else (0, 0))
            pipe.send(("ok", stats, getattr(conn, "num_imports", None)))
        elif cmd == "recv_fresh":  # count receives, each into a buffer of its own (the last one freed first)
            n, tag, count = args
            stats = []
            for _ in range(count):
                buf = empty(n, device)
                conn.recv(buf, tag=tag, timeout=T)
                stats.append((int(buf.min()), int(buf.max())))
                del buf
            pipe.send(("ok", stats, getattr(conn, "num_dest_exports", None)))
        elif cmd == "exit":
            break
    transport.close()


def connected(transport: Transport, peer: Child):
    address = transport.listen()
    peer.send("connect", address)
    conn = transport.accept(T)
    assert peer.recv() == ("ok",)
    return conn


def pair(server: Transport, client: Transport) -> tuple[Connection, Connection]:
    """Two transports of this process connected: (the client's connection, the server's)."""
    import threading

    address = server.listen()
    accepted = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept(T)))
    acceptor.start()
    conn = client.connect(address, T)
    acceptor.join()
    return conn, accepted[0]


# --- the checks ---


def check_round_trip_sizes(
    make: MakeTransport,
    sizes=(0, 1, 7, 64, 4097, MiB + 3, 64 * MiB),
    device: str = "cpu",
    *,
    peer_device: str | None = None,
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> Connection:
    """Each size to an echoing peer and back, exact. The peer's buffers are on
    ``peer_device`` (default: ``device``); this side's come from ``alloc`` (default:
    on ``device``). Returns this side's connection, its peer gone."""
    alloc = alloc or (lambda n: empty(n, device))
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", peer_device or device) as peer:
        conn = connected(transport, peer)
        peer.send("echo", list(sizes), 10)
        for i, n in enumerate(sizes):
            data = alloc(n)
            data.copy_(pattern(n, i, device))
            back = alloc(n)
            back.fill_(0xAB)
            receive = conn.irecv(back, tag=11)
            conn.send(data, tag=10, timeout=T, step=100 + i, bucket=i)
            header = receive.wait(T)
            assert (header.step, header.bucket, header.nbytes) == (100 + i, i, n)
            assert torch.equal(back, data), f"{n}-byte bucket came back different"
        assert peer.recv() == ("ok",)
    return conn


def check_many_in_flight_and_tags(make: MakeTransport, device: str = "cpu") -> None:
    # 16 buckets on 16 tags, sent in reverse order of the peer's receives:
    # matching is by tag, and all of them are in flight at once on both sides.
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        specs = [(MiB + i * 4096, 1000 + i) for i in range(16)]
        peer.send("recv_all", specs)
        datas = [pattern(n, i, device) for i, (n, _) in enumerate(specs)]
        sends = [
            conn.isend(d, tag=tag, bucket=i)
            for i, (d, (_, tag)) in reversed(list(enumerate(zip(datas, specs, strict=False))))
        ]
        for s in sends:
            s.wait(T)
        status, buckets, sums = peer.recv()
        assert status == "ok" and buckets == list(range(16))
        assert sums == [int(d.sum()) for d in datas]


def check_timeout(make: MakeTransport, timeout_s: float = 0.5, device: str = "cpu") -> None:
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        start = time.monotonic()
        try:
            conn.recv(empty(8, device), tag=77, timeout=timedelta(seconds=timeout_s))
        except TransferTimeoutError:
            elapsed = time.monotonic() - start
        else:
            raise AssertionError("a receive nobody answers returned")
        assert timeout_s <= elapsed < timeout_s + 5
        assert not conn.alive  # a timed-out transfer closes its connection


def check_wrong_token_refused(make: MakeTransport, device: str = "cpu") -> None:
    with make(b"job-token") as transport, spawn(peer_main, make, b"not-the-token", device) as peer:
        address = transport.listen()
        peer.send("connect", address)
        try:
            transport.accept(T)
        except AuthenticationError as exc:
            assert "wrong job token" in str(exc) and "job-token" not in str(exc)
        else:
            raise AssertionError("a peer with the wrong token was accepted")
        status, message = peer.recv()
        assert status == "AuthenticationError" and "refused" in message


def check_missing_token_refused(make: MakeTransport, device: str = "cpu") -> None:
    with make(b"job-token") as transport:
        host, port = transport.listen().rsplit(":", 1)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(200))
            try:
                transport.accept(T)
            except AuthenticationError as exc:
                assert "did not present a job token" in str(exc)
            else:
                raise AssertionError("a peer without a token was accepted")
            raw.settimeout(10)
            try:  # the server closed the connection: EOF, or a reset as our junk was unread
                while raw.recv(4096):
                    pass
            except ConnectionResetError:
                pass


def check_corrupted_bucket_rejected_and_resent(make: MakeTransport, device: str = "cpu") -> None:
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        data = pattern(3 * MiB, 5, device)
        conn.faults.corrupt_next = 1
        peer.send("recv_verify", data.numel(), 20)
        conn.send(data, tag=20, timeout=T, step=9, bucket=4)
        assert conn.faults.corrupted == 1, "the corruption fault did not fire"
        assert peer.recv() == ("BucketCorruptedError", 4, 9)
        peer.send("recv_verify", data.numel(), 20)  # the same bucket again, clean
        conn.send(data, tag=20, timeout=T, step=9, bucket=4)
        assert peer.recv()[:2] == ("ok", int(data.sum()))
        assert conn.faults.corrupted == 1


def check_bucket_in_pieces(make: MakeTransport, device: str = "cpu") -> None:
    """A bucket above PIECE_BYTES travels as pieces: it arrives whole, with the digest of
    the whole keyed from its offset; a flip in a middle piece fails the bucket only once
    every piece is in, so the resend and the next bucket on the tag arrive intact."""
    n = 2 * PIECE_BYTES + 4099  # three pieces, the last of an odd length
    offset = 8 * 12345
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        data = pattern(n, 6, device)
        for corrupt in (True, False):
            conn.faults.corrupt_next = int(corrupt)
            peer.send("recv_verify", n, 25)
            sent = conn.send(data, tag=25, timeout=T, step=3, bucket=2, offset=offset)
            got = peer.recv()
            if corrupt:
                assert conn.faults.corrupted == 1, "the corruption fault did not fire"
                assert got == ("BucketCorruptedError", 2, 3)
            else:
                assert got == ("ok", int(data.sum()), offset, n, sent.digest)
                assert sent.digest == bucket_digest(data.cpu(), offset=offset) != 0
        small = pattern(100, 7, device)
        peer.send("recv_verify", 100, 25)
        conn.send(small, tag=25, timeout=T)
        assert peer.recv()[:2] == ("ok", int(small.sum()))


def messages_of_a_bucket(make: MakeTransport, nbytes: int, device: str = "cpu") -> list[int]:
    """The sizes of the messages one bucket of ``nbytes`` goes in (the backend's pieces),
    sent to a peer that receives and verifies it whole."""
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        sizes = []
        real = conn._isend

        def counted(flat, tag, header, ready):
            sizes.append(flat.numel())
            return real(flat, tag, header, ready)

        conn._isend = counted
        data = pattern(nbytes, 8, device)
        peer.send("recv_verify", nbytes, 26)
        sent = conn.send(data, tag=26, timeout=T, step=1, bucket=1)
        assert peer.recv() == ("ok", int(data.sum()), 0, nbytes, sent.digest)
        return sizes


def check_peer_killed_mid_transfer(make: MakeTransport, nbytes: int = 512 * MiB, device: str = "cpu") -> None:
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        receive = conn.irecv(empty(nbytes, device), tag=30)
        # A GPU moves the whole bucket in about a millisecond, before this check
        # could look: there the peer's bytes wait behind a kernel that runs for
        # seconds, so the transfer is in flight at the kill whatever the speed.
        peer.send("send_stalled" if device == "cuda" else "send", nbytes, 30, 1)
        assert peer.recv() == ("posted",)
        assert not receive.done(), "the transfer finished before the kill"
        peer.kill()
        killed_at = time.monotonic()
        assert peer.process.exitcode == -9, "the peer was not killed"
        try:
            receive.wait(timedelta(seconds=30))
        except PeerDisconnectedError:
            noticed = time.monotonic() - killed_at
        else:
            raise AssertionError("a receive from a killed peer completed")
        assert noticed < 2.0, f"survivor took {noticed:.2f} s to notice the dead peer"
        assert not conn.alive
        # The survivor keeps working: a new peer connects and a round trip succeeds.
        with spawn(peer_main, make, b"job-token", device) as fresh:
            assert_echoes(connected(transport, fresh), fresh, device)


def assert_echoes(conn, peer: Child, device: str = "cpu") -> None:
    """One MiB to ``peer`` (a ``peer_main``) and back over ``conn``, exact: the connection works."""
    peer.send("echo", [MiB], 40)
    back = empty(MiB, device)
    receive = conn.irecv(back, tag=41)
    conn.send(pattern(MiB, 2, device), tag=40, timeout=T)
    receive.wait(T)
    assert torch.equal(back, pattern(MiB, 2, device)) and peer.recv() == ("ok",)


def check_frozen_peer_times_out(make: MakeTransport, timeout_s: float = 1.0, device: str = "cpu") -> None:
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        peer.freeze()
        deadline = Deadline.after(timedelta(seconds=5))
        while process_state(peer.pid) != "T" and not deadline.expired:
            time.sleep(0.01)
        assert process_state(peer.pid) == "T", "the peer was not stopped"
        start = time.monotonic()
        try:
            conn.recv(empty(MiB, device), tag=50, timeout=timedelta(seconds=timeout_s))
        except TransferTimeoutError:
            elapsed = time.monotonic() - start
        else:
            raise AssertionError("a receive from a frozen peer completed")
        assert timeout_s <= elapsed < timeout_s + 5
        assert process_state(peer.pid) == "T"


CHECKS = [
    check_round_trip_sizes,
    check_many_in_flight_and_tags,
    check_timeout,
    check_wrong_token_refused,
    check_missing_token_refused,
    check_corrupted_bucket_rejected_and_resent,
    check_bucket_in_pieces,
    check_peer_killed_mid_transfer,
    check_frozen_peer_times_out,
]


def run_transport_contract(make: MakeTransport, check: Callable[..., None] | None = None, device: str = "cpu") -> None:
    """Run one check (or all of them) against the backend that ``make(token)`` builds,
    moving buffers on ``device``."""
    for c in CHECKS if check is None else [check]:
        c(make, device=device)


def check_completed_transfer_survives_peer_exit(make: MakeTransport, device: str = "cpu") -> None:
    # A bucket that arrived in full stays delivered when its sender exits right after.
    with make(b"job-token") as transport, spawn(peer_main, make, b"job-token", device) as peer:
        conn = connected(transport, peer)
        back = empty(MiB, device)
        receive = conn.irecv(back, tag=60)
        peer.send("send", MiB, 60, 3)
        assert peer.recv() == ("posted",)
        assert peer.recv() == ("ok",)
        peer.send("exit")
        peer.process.join(30)
        assert peer.process.exitcode == 0, "the peer did not exit"
        deadline = Deadline.after(timedelta(seconds=5))
        while conn.alive and not deadline.expired:
            time.sleep(0.01)
        assert not conn.alive, "the peer's exit was not noticed"
        receive.wait(T)
        assert torch.equal(back, pattern(MiB, 3, device))


CHECKS.append(check_completed_transfer_survives_peer_exit)
