"""The transport contract on device memory: CUDA IPC, and UCX (cuda_ipc / cuda_copy)."""

import pytest

from replica.transport.ipc import IpcConfig, IpcTransport
from replica.transport.ucx import UcxConfig, UcxTransport

from transport_contract import CHECKS, run_transport_contract

pytestmark = pytest.mark.gpu


def make_ipc(token: bytes) -> IpcTransport:
    return IpcTransport(IpcConfig(token=token))


def make_ucx(token: bytes) -> UcxTransport:
    return UcxTransport(UcxConfig(token=token))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("make", [make_ipc, make_ucx], ids=["ipc", "ucx"])
def test_contract_cuda(make, check):
    run_transport_contract(make, check, device="cuda")
