"""The transport contract against the NIXL backend (NIXL's UCX plugin, host memory: no
GPU here), its registrations, its errors, and a transfer between two network-namespace
hosts. Skipped where NIXL is not installed (`make test` installs it: replica[nixl])."""

from __future__ import annotations

import functools
import threading
from datetime import timedelta

import pytest
import torch

from replica.errors import TransportError
from replica.session import backends
from replica.transport.base import PIECE_BYTES
from replica.transport.nixl_agent import nixl_installed

from transport_contract import (
    CHECKS,
    MiB,
    T,
    check_round_trip_sizes,
    connected,
    empty,
    messages_of_a_bucket,
    pattern,
    peer_main,
    run_transport_contract,
)
from replica._testing import spawn

pytestmark = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'replica[nixl]')")


def make_nixl(token: bytes, **options):
    from replica.transport.nixl import NixlConfig, NixlTransport

    return NixlTransport(NixlConfig(token=token, **options))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_nixl(check):
    run_transport_contract(make_nixl, check)


def test_round_trip_512_mib():
    run_transport_contract(make_nixl, functools.partial(check_round_trip_sizes, sizes=(512 * MiB,)))


def test_a_large_bucket_goes_in_pieces_and_small_ones_whole():
    assert messages_of_a_bucket(make_nixl, 2 * PIECE_BYTES + 4099) == [PIECE_BYTES, PIECE_BYTES, 4099]


def _pair(server, client):
    address = server.listen()
    accepted = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept(T)))
    acceptor.start()
    conn = client.connect(address, T)
    acceptor.join()
    return conn, accepted[0]


def test_a_storage_is_registered_once_for_every_bucket_in_it():
    """Buckets sent from slices of one buffer into slices of another: each side registers
    its storage once, whatever the number of buckets; the bytes arrive exact."""
    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = _pair(server, client)
        before = client.agent.registered
        source, target = pattern(32 * MiB, 4), empty(32 * MiB, "cpu", fill=0)
        for _ in range(3):
            receives = [other.irecv(target[i * 4 * MiB:(i + 1) * 4 * MiB], tag=7) for i in range(8)]
            for i in range(8):
                conn.send(source[i * 4 * MiB:(i + 1) * 4 * MiB], tag=7, timeout=T, bucket=i)
            assert [r.wait(T).bucket for r in receives] == list(range(8))
        assert torch.equal(source, target)
        # One process, one agent: both storages, once each.
        assert client.agent.registered - before == 2, client.agent.registered - before


def test_a_send_larger_than_its_receive_is_refused_by_the_receiver():
    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = _pair(server, client)
        receive = other.irecv(empty(MiB, "cpu", fill=0), tag=3)
        conn.send(pattern(2 * MiB, 1), tag=3, timeout=T)
        with pytest.raises(TransportError, match="bytes into a"):
            receive.wait(T)


def test_small_messages_need_no_posted_receive():
    """Messages under INLINE_BYTES go at once, like UCX's eager sends: both sides may send
    before either posts its receive."""
    from replica.transport.nixl import INLINE_BYTES

    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = _pair(server, client)
        small = pattern(INLINE_BYTES - 8, 2)
        conn.send(small, tag=9, timeout=timedelta(seconds=5))
        other.send(small, tag=9, timeout=timedelta(seconds=5))
        for side in (conn, other):
            back = empty(small.numel(), "cpu", fill=0)
            side.recv(back, tag=9, timeout=T)
            assert torch.equal(back, small)


def test_a_plugin_nixl_does_not_have_is_refused_naming_what_it_has():
    with pytest.raises(TransportError, match="NIXL has no backend 'NOSUCH'.*UCX"):
        make_nixl(b"job-token", plugin="NOSUCH")
    with pytest.raises(ValueError, match="capitals"):
        make_nixl(b"job-token", plugin="ucx")
    with pytest.raises(ValueError, match="pairs of str"):
        make_nixl(b"job-token", plugin_params=(("num_workers", 1),))


def test_the_environment_names_the_plugin_and_a_bad_one_stops_the_launch():
    assert backends.nixl_options({"REPLICA_NIXL_BACKEND": "LIBFABRIC", "REPLICA_NIXL_PARAMS": "a=1, b=x"}) == {
        "plugin": "LIBFABRIC", "plugin_params": (("a", "1"), ("b", "x"))}
    with pytest.raises(ValueError, match="name=value"):
        backends.nixl_options({"REPLICA_NIXL_PARAMS": "junk"})
    from roles.local_agent import open_job  # noqa: F401 - importable the way `replica launch` uses it

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPLICA_NIXL_BACKEND", "NOSUCH")
        with pytest.raises(TransportError, match="NOSUCH"):
            backends.check_backends(("nixl", "gloo"))
    backends.check_backends(("nixl",))  # the default plugin is there


def test_nixl_named_but_not_installed_is_one_clear_error(monkeypatch):
    # NIXL is installed here, so its absence is simulated where the backend looks for it.
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec",
                        lambda name, *a: None if name == "nixl" else real(name, *a))
    with pytest.raises(TransportError, match=r"'nixl' is not available: nixl is not installed \(pip install "
                                             r"'replica\[nixl\]'\)"):
        backends.check_backends(("nixl",))


def test_nixl_is_chosen_by_default_only_where_ucx_is_missing(monkeypatch):
    from replica.config import Config
    from replica.transport import Locality, MemoryKind

    config = Config(token=b"t")
    assert backends.choose_backend(config, MemoryKind.CUDA, Locality.REMOTE) == "ucx"
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ucxx" else real(name, *a))
    assert backends.choose_backend(config, MemoryKind.CUDA, Locality.REMOTE) == "nixl"


def test_a_killed_peer_frees_nothing_it_did_not_own():
    """After a peer dies mid-transfer the survivor's agent forgets it, and a fresh peer
    gets a working connection from the same agent (no new agent, no restart)."""
    with make_nixl(b"job-token") as transport, spawn(peer_main, make_nixl, b"job-token") as peer:
        agent = transport.agent
        conn = connected(transport, peer)
        assert conn._peer_agent in agent._remotes
        peer.kill()
        from replica._testing import wait_for

        wait_for(lambda: not conn.alive and conn._peer_agent not in agent._remotes, "the dead peer forgotten",
                 timeout_s=10)
        with spawn(peer_main, make_nixl, b"job-token") as fresh:
            fresh_conn = connected(transport, fresh)
            assert transport.agent is agent
            fresh.send("echo", [MiB], 40)
            back = empty(MiB, "cpu")
            receive = fresh_conn.irecv(back, tag=41)
            fresh_conn.send(pattern(MiB, 2), tag=40, timeout=T)
            receive.wait(T)
            assert torch.equal(back, pattern(MiB, 2)) and fresh.recv() == ("ok",)
