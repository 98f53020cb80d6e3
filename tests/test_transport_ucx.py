"""The transport contract against the UCX backend, on shared memory and on tcp."""

import functools

import pytest

from replica.transport.ucx import UcxConfig, UcxTransport

from transport_contract import (
    CHECKS,
    MiB,
    check_peer_killed_mid_transfer,
    check_round_trip_sizes,
    run_transport_contract,
)


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
