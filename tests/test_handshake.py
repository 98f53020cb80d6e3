"""Control-socket handshakes under faults: each accepted connection authenticates
on its own thread under its own deadline, so a slow peer is not taken for a
dead one and idle or junk sockets delay no one; a cap bounds the handshakes in
progress; EOF or a stall during a handshake is a retryable TransportError, a
wrong token an AuthenticationError. Real sockets throughout; the legitimate
peers of the slow-handshake and junk-socket checks are spawned processes."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from replica.config import Config
from replica.errors import (
    AuthenticationError,
    PeerDisconnectedError,
    ReplicaError,
    TransferTimeoutError,
    TransportError,
)
from replica.session.listener import Listener
from replica.timing import Deadline
from replica.transport import MemoryKind, wire
from replica.transport.control import (
    ControlledConnection,
    ControlledTransport,
    EndpointConfig,
    client_handshake,
    parse_address,
    server_handshake,
)
from replica.transport.gloo import GlooConfig, GlooTransport
from replica.transport.ipc import IpcConfig, IpcTransport
from replica.transport.ucx import UcxConfig, UcxTransport
from support.children import spawn
from support.transport_contract import peer_main

TOKEN = b"job-token"
T = timedelta(seconds=60)
POLL = timedelta(seconds=0.1)  # the Listener's accept poll
HELLO_DELAY_S = 0.5  # past the old 0.1 s handshake budget
NUM_JUNK = 40
CONTROL_LOGGER = "replica.transport.control"


def make_ucx(token: bytes, **options) -> UcxTransport:
    return UcxTransport(UcxConfig(token=token, **options))


def make_gloo(token: bytes, **options) -> GlooTransport:
    return GlooTransport(GlooConfig(token=token, **options))


def make_ipc(token: bytes, **options) -> IpcTransport:
    return IpcTransport(IpcConfig(token=token, **options))


BACKENDS = {"ucx": make_ucx, "gloo": make_gloo, "ipc": make_ipc}


# --- the legitimate peer: the contract's, in a spawned process, optionally slow to say Hello ---


def timed_peer(pipe, make, token: bytes, hello_delay_s: float = 0.0) -> None:
    if hello_delay_s:
        original = wire.Hello.encode

        def slow_encode(self) -> bytes:  # the client's Hello leaves late
            time.sleep(hello_delay_s)
            pipe.send(("hello delayed", hello_delay_s))
            return original(self)

        wire.Hello.encode = slow_encode
    pipe.send(("ready",))  # imports done: a connect timed from here is the connect alone
    peer_main(pipe, make, token)


def ready(peer) -> None:
    assert peer.recv() == ("ready",)


def connect_timed(peer, address: str, *, delayed: bool = False) -> float:
    """Has the (ready) peer connect; returns the seconds it took."""
    start = time.monotonic()
    peer.send("connect", address)
    if delayed:
        assert peer.recv() == ("hello delayed", HELLO_DELAY_S), "the Hello was not delayed"
    reply = peer.recv()
    assert reply == ("ok",), reply
    return time.monotonic() - start


def echo(conn, peer, nbytes: int = 4096) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    back = torch.zeros(nbytes, dtype=torch.uint8)
    peer.send("echo", [nbytes], 1)  # received on tag 1, sent back on tag 2
    receive = conn.irecv(back, tag=2)
    conn.send(data, tag=1, timeout=T)
    receive.wait(T)
    assert peer.recv() == ("ok",) and torch.equal(back, data)


# --- raw sockets ---


def recv_exact(sock: socket.socket, n: int, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"EOF after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_challenge(sock: socket.socket) -> bytes:
    return wire.decode_challenge(recv_exact(sock, wire.CHALLENGE_BYTES))


@pytest.fixture
def log(caplog):
    """The control channel's warnings, captured."""
    with caplog.at_level(logging.WARNING, logger=CONTROL_LOGGER):
        yield caplog


def eventually(condition, within_s: float = 10.0) -> bool:
    deadline = Deadline.after(timedelta(seconds=within_s))
    while not condition():
        if deadline.expired:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def listening(make, **options):
    """A transport listening on loopback, and its address."""
    with make(TOKEN, **options) as transport:
        yield transport, transport.listen()


@contextlib.contextmanager
def challenged(address: str):
    """A raw socket to ``address`` that read the server's challenge: yields it and the nonce."""
    with socket.create_connection(parse_address(address), timeout=10) as raw:
        yield raw, read_challenge(raw)


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    finally:
        sock.setblocking(True)


def closed_by_server(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``timeout_s``, and what it sent first."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        pass
    return True, got


def junk_sockets(address: str, n: int) -> list[socket.socket]:
    return [socket.create_connection(parse_address(address), timeout=10) for _ in range(n)]


def accepting(transport) -> queue.Queue:
    """A Listener's accept loop on a thread, 0.1 s polls; its first connection
    (or error) lands in the queue."""
    accepted: queue.Queue = queue.Queue()

    def loop() -> None:
        end = Deadline.after(timedelta(seconds=60))
        while not end.expired:
            try:
                accepted.put(transport.accept(POLL))
                return
            except TransferTimeoutError:
                continue
            except ReplicaError as exc:
                accepted.put(exc)
                return

    threading.Thread(target=loop, daemon=True).start()
    return accepted


def accepted_connection(accepted: queue.Queue):
    conn = accepted.get(timeout=60)
    assert not isinstance(conn, BaseException), repr(conn)
    return conn


# --- (a) a slow Hello, (b) junk sockets: per backend, with a spawned peer ---


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_slow_hello_still_connects_through_a_polling_accept_loop(backend):
    make = BACKENDS[backend]
    with make(TOKEN) as transport, spawn(timed_peer, make, TOKEN, HELLO_DELAY_S) as peer:
        address = transport.listen()
        accepted = accepting(transport)
        ready(peer)
        elapsed = connect_timed(peer, address, delayed=True)
        assert elapsed >= HELLO_DELAY_S, f"connect took {elapsed:.2f} s: the delay did not hold the handshake"
        echo(accepted_connection(accepted), peer)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_idle_sockets_do_not_delay_a_legitimate_connect(backend):
    make = BACKENDS[backend]
    with spawn(timed_peer, make, TOKEN) as peer:
        # Junk handshakes that outlast the test: whether they are still pending
        # says the connect did not wait for them.
        transport = make(TOKEN, handshake_timeout=timedelta(seconds=120))
        try:
            address = transport.listen()
            accepted = accepting(transport)
            ready(peer)
            junk = junk_sockets(address, NUM_JUNK)
            # Each is challenged at once, all at the same time: none waits for another.
            for sock in junk:
                read_challenge(sock)
            elapsed = connect_timed(peer, address)
            conn = accepted_connection(accepted)
            # The connect went through while every junk socket was still pending;
            # its time is its own (generous: 5x a 2 s bound), not the junk's.
            assert all(still_open(s) for s in junk), "a junk socket was dropped before the connect finished"
            assert elapsed < 10.0, f"connect took {elapsed:.2f} s behind {NUM_JUNK} idle sockets"
            echo(conn, peer)
        finally:
            start = time.monotonic()
            transport.close()
            closing = time.monotonic() - start
        assert closing < 5.0, f"close() took {closing:.2f} s with handshakes pending"
        for sock in junk:  # close() ended their handshakes
            assert closed_by_server(sock, 5.0)[0]
            sock.close()


# --- the Listener itself: a slow standby behind junk sockets is not lost ---


class _Accepting(Listener):
    def __init__(self, config: Config):
        super().__init__(config=config, memory=MemoryKind.HOST, name="test listener")
        self.accepted: queue.Queue = queue.Queue()
        self._start()

    def _session(self, conn) -> None:
        self.accepted.put(conn)
        self._closed.wait()


def test_listener_keeps_a_slow_peer_behind_junk_sockets():
    config = Config(token=TOKEN, backends=("ucx",))
    with _Accepting(config) as listener, spawn(timed_peer, make_ucx, TOKEN, HELLO_DELAY_S) as peer:
        ready(peer)
        junk = junk_sockets(listener.address, NUM_JUNK)
        try:
            for sock in junk:
                read_challenge(sock)
            connect_timed(peer, listener.address, delayed=True)
            conn = listener.accepted.get(timeout=10)
            echo(conn, peer)
        finally:
            for sock in junk:
                sock.close()


# --- (c) the cap on pending handshakes ---


@pytest.mark.parametrize("backend", ["ipc", "ucx"])
def test_sockets_beyond_the_cap_are_closed_at_once(backend, log):
    make = BACKENDS[backend]
    cap, extra = 4, 6
    # The pending ones outlast the test unless their client ends them.
    options = {"max_pending_handshakes": cap, "handshake_timeout": timedelta(seconds=120)}
    with listening(make, **options) as (transport, address), make(TOKEN) as client:
        pending = junk_sockets(address, cap)
        for sock in pending:
            read_challenge(sock)  # all `cap` handshakes are now in progress
        extras = junk_sockets(address, extra)
        for sock in extras:
            closed, sent = closed_by_server(sock, 10.0)
            assert closed and sent == b"", "a socket beyond the cap was not closed at once"
        # A genuine peer refused at the cap sees a retryable error, not a wrong token.
        with pytest.raises(PeerDisconnectedError):
            client.connect(address, T)
        overflow = [r for r in log.records if "handshakes are already pending" in r.getMessage()]
        assert 1 <= len(overflow) <= extra, "the refusals were not logged, or not rate-limited"
        assert TOKEN.decode() not in log.text
        # Pending handshakes whose clients leave free their slots; then a peer gets in.
        for sock in pending:
            sock.shutdown(socket.SHUT_WR)
            assert closed_by_server(sock, 10.0)[0], "a vanished client's handshake was kept"
        conn = client.connect(address, T)
        assert transport.accept(T).alive and conn.alive
        for sock in pending + extras:
            sock.close()


def test_a_silent_socket_is_dropped_at_the_handshake_deadline(log):
    timeout = timedelta(seconds=0.5)
    with listening(make_ipc, handshake_timeout=timeout) as (transport, address):
        with challenged(address) as (raw, _):
            start = time.monotonic()
            closed, _ = closed_by_server(raw, 30.0)
            assert closed, "a silent socket outlived its handshake deadline"
            assert time.monotonic() - start >= timeout.total_seconds() * 0.9
        deadline = Deadline.after(timedelta(seconds=10))  # the handshake thread logs just after it closed the socket
        while "timed out" not in log.text and not deadline.expired:
            time.sleep(0.01)
        assert "timed out" in log.text
        with pytest.raises(TransferTimeoutError):  # a dropped handshake is no refusal to raise
            transport.accept(POLL)


# --- (d) error types ---


def _handshake_against(side, act, **kwargs) -> BaseException | None:
    """Runs one side's handshake on a thread while ``act`` plays the other end
    by hand; returns what the handshake raised (None if it succeeded)."""
    mine, theirs = socket.socketpair()
    error: list[BaseException] = []

    def body() -> None:
        try:
            side(mine, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            error.append(exc)

    with mine, theirs:
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        act(theirs)
        thread.join(10)
        assert not thread.is_alive(), "the handshake outlived its deadline"
    return error[0] if error else None


def _server(sock, token=TOKEN, timeout_s=5.0):
    return server_handshake(sock, peer="test-client", token=token, address=b"srv", inbound_id=1, timeout_s=timeout_s)


def _client(sock, token=TOKEN, timeout_s=5.0):
    return client_handshake(sock, peer="test-server", token=token, address=b"cli", inbound_id=2, timeout_s=timeout_s)


def _vanish_after_challenge(sock) -> None:
    read_challenge(sock)
    sock.close()


def _vanish_after_hello(sock) -> None:
    sock.sendall(wire.encode_challenge(wire.new_nonce()))
    wire.Hello.decode(recv_exact(sock, wire.Hello.fixed_size()), lambda n: recv_exact(sock, n))
    sock.close()


def _silent(sock) -> None:
    pass  # the socket stays open and mute until the handshake gave up


@pytest.mark.parametrize(
    "side, act, timeout_s, raises",
    [
        (_server, _vanish_after_challenge, 5.0, PeerDisconnectedError),
        (_server, _silent, 0.3, TransferTimeoutError),
        (_client, _vanish_after_hello, 5.0, PeerDisconnectedError),  # was AuthenticationError
        (_client, _silent, 0.3, TransferTimeoutError),
    ],
    ids=["server-eof", "server-stall", "client-eof", "client-stall"],
)
def test_handshake_eof_or_stall_is_a_retryable_transport_error(side, act, timeout_s, raises):
    exc = _handshake_against(side, act, timeout_s=timeout_s)
    assert isinstance(exc, raises) and not isinstance(exc, AuthenticationError), repr(exc)


def test_wrong_or_missing_token_is_an_authentication_error():
    client_error: list[BaseException] = []

    def intruder(sock) -> None:
        try:
            _client(sock, token=b"not-the-token")
        except AuthenticationError as exc:
            client_error.append(exc)

    server_error = _handshake_against(_server, intruder)
    for exc, says in ((server_error, "wrong job token"), (client_error[0], "refused")):
        assert isinstance(exc, AuthenticationError) and not isinstance(exc, TransportError)
        assert says in str(exc) and "job-token" not in str(exc)
    junk = _handshake_against(_server, lambda sock: sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(200)))
    assert isinstance(junk, AuthenticationError) and "did not present a job token" in str(junk)


def _hand_server(listener: socket.socket, hello_seen: threading.Event) -> None:
    """Challenges the client, reads its Hello, and closes without a Welcome."""
    sock, _ = listener.accept()
    with sock:
        sock.sendall(wire.encode_challenge(wire.new_nonce()))
        wire.Hello.decode(recv_exact(sock, wire.Hello.fixed_size()), lambda n: recv_exact(sock, n))
        hello_seen.set()


def test_connect_to_a_server_that_vanishes_mid_handshake_is_retryable():
    with socket.create_server(("127.0.0.1", 0)) as listener, make_ucx(TOKEN) as client:
        hello_seen = threading.Event()
        threading.Thread(target=_hand_server, args=(listener, hello_seen), daemon=True).start()
        host, port = listener.getsockname()[:2]
        with pytest.raises(PeerDisconnectedError):
            client.connect(f"{host}:{port}", T)
        assert hello_seen.is_set(), "the server did not get as far as the Hello"
        assert client._worker.users == 0, "the failed handshake kept its UCX offer"


@pytest.mark.parametrize("backend", ["ipc", "ucx"])
def test_a_client_vanishing_mid_handshake_is_logged_not_raised_by_accept(backend, log):
    make = BACKENDS[backend]
    with listening(make) as (transport, address), make(TOKEN) as client:
        with challenged(address):
            pass  # the client vanishes after the challenge
        assert eventually(lambda: "peer closed the connection" in log.text), "the vanished client was not noticed"
        with pytest.raises(TransferTimeoutError):  # nothing to hand out: no refusal, no connection
            transport.accept(POLL)
        conn = client.connect(address, T)
        assert transport.accept(T).alive and conn.alive


def test_wrong_token_is_refused_and_raised_by_accept(log):
    with listening(make_ipc) as (transport, address), make_ipc(b"not-the-token") as intruder, make_ipc(TOKEN) as client:
        with pytest.raises(AuthenticationError, match="refused"):
            intruder.connect(address, T)
        with pytest.raises(AuthenticationError, match="wrong job token"):
            transport.accept(T)
        assert "wrong job token" in log.text and "job-token" not in log.text
        conn = client.connect(address, T)
        assert transport.accept(T).alive and conn.alive


# --- step 5: backends' data paths under the handshake deadline ---


def test_gloo_gives_up_on_a_client_that_vanishes_after_the_handshake(log):
    # gloo's rendezvous would wait op_timeout (300 s) for the vanished client;
    # the handshake's deadline ends it.
    timeout = timedelta(seconds=3)
    with listening(make_gloo, handshake_timeout=timeout) as (transport, address):
        with challenged(address) as (raw, nonce):
            hello = wire.Hello(
                proof=wire.proof(TOKEN, nonce, b"client"), nonce=wire.new_nonce(), inbound_id=1, address=b""
            )
            raw.sendall(hello.encode())
            welcome = wire.Welcome.decode(recv_exact(raw, wire.Welcome.fixed_size()), lambda n: recv_exact(raw, n))
            assert welcome.accepted, "the hand-made client was not admitted"
        assert eventually(lambda: "opening the data path" in log.text), (
            "gloo's data path outlived the handshake deadline"
        )
        assert not transport._handshakes


class _FakeConnection(ControlledConnection):
    def _isend(self, flat, tag, header, ready):
        raise TransportError("no data path")

    def _irecv(self, flat, tag, header_buf, ready):
        raise TransportError("no data path")

    def _release(self) -> None:
        pass


class _CountingTransport(ControlledTransport):
    """A backend whose accepting side's ``_open`` fails, counting offers."""

    capabilities = IpcTransport.capabilities

    def __init__(self, config: EndpointConfig, *, fail_open: bool):
        super().__init__(config)
        self.fail_open = fail_open
        self.offers = self.discards = 0

    def _offer(self, server, locality):
        self.offers += 1
        return b"", object()

    def _discard_offer(self, state):
        self.discards += 1

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        if server and self.fail_open:
            raise RuntimeError("backend failed")
        return _FakeConnection(transport=self, sock=sock, peer=peer, memory=MemoryKind.HOST, verify=False)

    def _shutdown(self) -> None:
        pass


def test_failed_or_refused_handshakes_leave_no_offer_behind(log):
    config = EndpointConfig(token=TOKEN)
    with (
        _CountingTransport(config, fail_open=True) as server,
        _CountingTransport(config, fail_open=False) as client,
        _CountingTransport(EndpointConfig(token=b"not-the-token"), fail_open=False) as intruder,
    ):
        address = server.listen()
        with pytest.raises(AuthenticationError):
            intruder.connect(address, T)
        with pytest.raises(AuthenticationError):
            server.accept(T)
        assert server.offers == 0, "a refused client cost the server an offer"
        client.connect(address, T)  # the client's side opens; the server's _open fails
        assert eventually(lambda: server.discards == 1), "the failed handshake kept its offer"
        assert server.offers == 1
        # The offer is discarded before the handshake's thread logs why: wait for the line too.
        assert eventually(lambda: "opening the data path" in log.text and "backend failed" in log.text), log.text
        with pytest.raises(TransferTimeoutError):
            server.accept(POLL)


def test_config_checks_the_handshake_settings():
    config = EndpointConfig(token=TOKEN)
    assert config.handshake_timeout == timedelta(seconds=10) and config.max_pending_handshakes == 64
    assert "job-token" not in repr(UcxConfig(token=TOKEN, handshake_timeout=timedelta(seconds=3)))
    for bad in (
        {"handshake_timeout": timedelta(0)},
        {"handshake_timeout": 5.0},
        {"max_pending_handshakes": 0},
        {"max_pending_handshakes": True},
        {"verify_threads": -1},
        {"verify_threads": True},
        {"verify_threads": 2.0},
    ):
        with pytest.raises(ValueError):
            EndpointConfig(token=TOKEN, **bad)


def test_receivers_verify_on_all_cores_but_two_unless_told():
    from replica.transport.base import resolve_verify_threads

    cores = len(os.sched_getaffinity(0))
    auto = max(1, min(8, cores - 2))
    assert resolve_verify_threads(0) == auto
    assert resolve_verify_threads(5) == 5 and resolve_verify_threads(20) == 20
    conn = _FakeConnection(transport=None, sock=None, peer="p", memory=MemoryKind.HOST, verify=True, verify_threads=0)
    assert conn._verify_threads == auto


def test_local_addresses_are_told_from_other_hosts():
    from replica.transport.control import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("127.0.0.2")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this host's address on its default route
        try:
            s.connect(("192.0.2.1", 9))
            own = s.getsockname()[0]
        except OSError:
            own = None
    if own is not None and own != "0.0.0.0":
        assert is_local_address(own)
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never a local interface's
    assert not is_local_address("not-an-address")
