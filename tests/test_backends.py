"""Choosing a transport backend by capability, and what happens when one is not installed."""

from __future__ import annotations

import importlib.util

import pytest

import replica
from replica.errors import TransportError
from replica.session.backends import backend_class, choose_backend, choose_backends
from replica.transport import Locality, MemoryKind


def config(**kw):
    return replica.Config(token=b"backends-test", **kw)


def test_default_order_by_memory_and_locality():
    assert choose_backend(config(), MemoryKind.HOST, Locality.SAME_NODE) == "shm"  # one copy, within a node
    assert choose_backend(config(), MemoryKind.HOST, Locality.REMOTE) == "ucx"
    assert choose_backend(config(), MemoryKind.CUDA, Locality.SAME_NODE) == "ipc"  # within a node
    assert choose_backend(config(), MemoryKind.CUDA, Locality.REMOTE) == "ucx"  # IPC cannot leave the node


def test_a_listener_on_shm_also_listens_on_the_next_backend_that_fits():
    """shm refuses peers of another user or PID namespace, which no listener can know in
    advance: it gets a fallback. No other choice does, nor shm with nothing after it."""
    assert choose_backends(config(), MemoryKind.HOST, Locality.SAME_NODE) == ("shm", "ucx")
    assert choose_backends(config(), MemoryKind.HOST, Locality.REMOTE) == ("ucx", None)
    assert choose_backends(config(), MemoryKind.CUDA, Locality.SAME_NODE) == ("ipc", None)
    assert choose_backends(config(backends=("shm", "gloo")), MemoryKind.HOST, Locality.SAME_NODE) == ("shm", "gloo")
    assert choose_backends(config(backends=("shm",)), MemoryKind.HOST, Locality.SAME_NODE) == ("shm", None)
    assert choose_backends(config(backends=("shm", "ipc")), MemoryKind.HOST, Locality.SAME_NODE) == ("shm", None)


def test_a_fallback_connection_keeps_off_shared_memory():
    """A peer refused by shm cannot map this process's memory, so UCX must not reach it
    through shared memory either (its FIFOs would time out): the fallback's transport
    takes the way to another host. Backends without the option ignore the request."""
    from replica.session.backends import make_backend

    with make_backend("ucx", config(), share_memory=False) as transport:
        assert transport.config.share_memory is False
        assert list(transport._current) == [Locality.REMOTE]
    with make_backend("ucx", config()) as transport:
        assert transport.config.share_memory is True and list(transport._current) == [Locality.SAME_NODE]
    with make_backend("gloo", config(), share_memory=False) as transport:
        assert not hasattr(transport.config, "share_memory")


def test_shm_when_listed_takes_host_memory_within_the_node_only():
    shm_first = config(backends=("shm", "ipc", "ucx", "gloo"))
    assert choose_backend(shm_first, MemoryKind.HOST, Locality.SAME_NODE) == "shm"
    assert choose_backend(shm_first, MemoryKind.HOST, Locality.REMOTE) == "ucx"  # shared memory cannot leave it
    assert choose_backend(shm_first, MemoryKind.CUDA, Locality.REMOTE) == "ucx"
    assert choose_backend(config(backends=("ipc", "shm", "ucx")), MemoryKind.CUDA, Locality.SAME_NODE) == "ipc"


def test_uninstalled_ucxx_falls_back_instead_of_failing_later(monkeypatch):
    # Neither UCX nor NIXL (the default's next choice where UCX is missing: tests/test_transport_nixl.py)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("ucxx", "nixl") else real(name, *a)
    )
    with pytest.raises(TransportError, match="ucxx is not installed"):
        backend_class("ucx")
    assert choose_backend(config(), MemoryKind.HOST, Locality.REMOTE) == "gloo"
    assert choose_backends(config(), MemoryKind.HOST, Locality.SAME_NODE) == ("shm", "gloo")
    with pytest.raises(TransportError, match="no transport moves CUDA memory to a REMOTE peer"):
        choose_backend(config(), MemoryKind.CUDA, Locality.REMOTE)


def test_a_shared_buffer_that_cannot_be_made_is_a_plain_one(monkeypatch, caplog):
    """Out of memfds, a snapshot or weight buffer asked for in shared memory is still made, in
    plain memory, with a warning (the shm backend then stages its buckets)."""
    import errno

    from replica.transport import memfd
    from replica.transport.buffers import transfer_buffer

    def no_memfd(nbytes, **_):
        raise OSError(errno.EMFILE, "Too many open files (injected)")

    monkeypatch.setattr(memfd, "shared_empty", no_memfd)
    buf = transfer_buffer(1 << 20, shared=True)
    assert buf.numel() == 1 << 20 and not buf.any() and memfd.region_of(buf) is None
    assert any("cannot allocate" in r.getMessage() and "injected" in r.getMessage() for r in caplog.records)


def test_verify_threads_reach_the_backend_and_bad_values_are_refused():
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="verify_threads"):
            config(verify_threads=bad)
    from replica.session.backends import make_backend

    with make_backend("gloo", config(verify_threads=3)) as transport:
        assert transport.config.verify_threads == 3
