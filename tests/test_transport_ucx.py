"""The transport contract against the UCX backend, on shared memory and on tcp."""

import functools
import time

import pytest
import torch

from replica.errors import PeerDisconnectedError

from replica.transport.ucx import UcxConfig, UcxTransport

from transport_contract import (
    CHECKS,
    MiB,
    T,
    check_peer_killed_mid_transfer,
    check_round_trip_sizes,
    connected,
    empty,
    pattern,
    peer_main,
    run_transport_contract,
)
from replica.testing import spawn


def make_ucx(token: bytes, **options) -> UcxTransport:
    return UcxTransport(UcxConfig(token=token, **options))


BACKENDS = {
    "ucx-default": make_ucx,
    "ucx-tcp": functools.partial(make_ucx, ucx_transports="tcp"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_ucx(check):
    run_transport_contract(BACKENDS["ucx-default"], check)


@pytest.mark.parametrize("check", [check_round_trip_sizes, check_peer_killed_mid_transfer], ids=lambda c: c.__name__)
def test_contract_tcp(check):
    run_transport_contract(BACKENDS["ucx-tcp"], check)


def test_round_trip_512_mib():
    run_transport_contract(BACKENDS["ucx-default"], functools.partial(check_round_trip_sizes, sizes=(512 * MiB,)))


def test_config_hides_token_and_checks_input():
    config = UcxConfig(token=b"s3cret")
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError):
        UcxConfig(token=b"")
    with pytest.raises(ValueError):
        UcxConfig(token=b"x", port=70000)


def test_a_peer_gone_without_goodbye_retires_the_worker():
    # A peer killed while writing into this worker's shared-memory FIFO can wedge
    # it for every later sender (seen under load: a fresh peer's echo stalled for
    # 60 s). So such a loss moves new connections to a fresh worker, and the old
    # one stops once its last connection is gone; a goodbye retires nothing.
    with make_ucx(b"job-token") as transport:
        first = transport._worker
        with spawn(peer_main, make_ucx, b"job-token") as peer:
            conn = connected(transport, peer)
            receive = conn.irecv(empty(64 * MiB, "cpu"), tag=30)
            peer.send("send", 64 * MiB, 30, 1)
            assert peer.recv() == ("posted",)
            peer.kill()
            assert peer.process.exitcode == -9, "the peer was not killed"
            with pytest.raises(PeerDisconnectedError):
                receive.wait(T)
        assert transport.retired_workers == 1 and transport._worker is not first
        deadline = time.monotonic() + 10  # the connection is released just after its error shows
        while not first.stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.stopped, "the retired worker's progress thread still runs"
        second = transport._worker
        with spawn(peer_main, make_ucx, b"job-token") as fresh:
            conn2 = connected(transport, fresh)
            assert conn2._worker is second
            fresh.send("echo", [MiB], 40)
            back = empty(MiB, "cpu")
            receive = conn2.irecv(back, tag=41)
            conn2.send(pattern(MiB, 2), tag=40, timeout=T)
            receive.wait(T)
            assert torch.equal(back, pattern(MiB, 2)) and fresh.recv() == ("ok",)
            conn2.close()  # this side's goodbye: the worker stays in service
        assert transport.retired_workers == 1 and transport._worker is second and not second.stopped
