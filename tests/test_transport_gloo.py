"""The transport contract against the gloo backend."""

import pytest

from replica.transport.gloo import GlooConfig, GlooTransport
from support.transport_contract import CHECKS, run_transport_contract


def make_gloo(token: bytes) -> GlooTransport:
    return GlooTransport(GlooConfig(token=token))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_gloo(check):
    run_transport_contract(make_gloo, check)
