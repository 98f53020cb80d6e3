"""Transport pieces that need no peer: wire records, capabilities, guards."""

import pytest
import torch

from replica.errors import TransportError
from replica.transport import BucketHeader, Capabilities, Locality, MemoryKind, select_transport
from replica.transport.gloo import GlooConfig, GlooTransport
from replica.transport.ipc import IpcConfig, IpcTransport
from replica.transport.ucx import UcxTransport
from replica.transport.wire import HEADER_BYTES, proof


def test_header_round_trip_and_rejects_garbage():
    header = BucketHeader(step=7, bucket=3, offset=1 << 40, nbytes=12345, digest=-5, fingerprint=99)
    data = header.encode()
    assert len(data) == HEADER_BYTES and BucketHeader.decode(data) == header
    with pytest.raises(ValueError, match="not a replica bucket header"):
        BucketHeader.decode(bytes(HEADER_BYTES))


def test_proof_depends_on_token_nonce_and_role():
    nonce = bytes(range(32))
    p = proof(b"token", nonce, b"client")
    assert p == proof(b"token", nonce, b"client")
    assert p != proof(b"token2", nonce, b"client")
    assert p != proof(b"token", nonce[::-1], b"client")
    assert p != proof(b"token", nonce, b"server")


def test_capabilities_choose_the_backend():
    assert UcxTransport.capabilities.supports(MemoryKind.CUDA, Locality.REMOTE)
    assert not IpcTransport.capabilities.supports(MemoryKind.CUDA, Locality.REMOTE)
    assert IpcTransport.capabilities.supports(MemoryKind.CUDA, Locality.SAME_NODE)
    assert not GlooTransport.capabilities.supports(MemoryKind.CUDA, Locality.SAME_NODE)
    ipc = IpcTransport(IpcConfig(token=b"t"))
    gloo = GlooTransport(GlooConfig(token=b"t"))
    try:
        assert select_transport([ipc, gloo], MemoryKind.CUDA, Locality.SAME_NODE) is ipc
        assert select_transport([ipc, gloo], MemoryKind.HOST, Locality.REMOTE) is gloo
        with pytest.raises(TransportError, match="no transport moves CUDA memory"):
            select_transport([gloo], MemoryKind.CUDA, Locality.REMOTE)
    finally:
        ipc.close()
        gloo.close()


def test_capabilities_record():
    caps = Capabilities(memory=MemoryKind.HOST, locality=Locality.SAME_NODE)
    assert caps.supports(MemoryKind.HOST, Locality.SAME_NODE)
    assert not caps.supports(MemoryKind.HOST, Locality.REMOTE)


def test_configs_refuse_empty_tokens_and_hide_them():
    for config in (GlooConfig, IpcConfig):
        with pytest.raises(ValueError):
            config(token=b"")
        assert "s3cret" not in repr(config(token=b"s3cret"))


def test_accept_needs_listen_and_timeouts_must_be_timedeltas():
    with GlooTransport(GlooConfig(token=b"t")) as transport:
        with pytest.raises(TransportError, match="accept\\(\\) before listen\\(\\)"):
            from datetime import timedelta

            transport.accept(timedelta(seconds=1))
        with pytest.raises(TypeError, match="timedelta"):
            transport.accept(1.0)


def test_listen_binds_loopback_by_default():
    with GlooTransport(GlooConfig(token=b"t")) as transport:
        assert transport.listen().startswith("127.0.0.1:")


def test_ipc_refuses_host_memory_without_a_gpu():
    # Without a peer there is no connection; the capability check is what refuses.
    assert MemoryKind.HOST not in IpcTransport.capabilities.memory
    assert torch.empty(1).device.type == "cpu"
