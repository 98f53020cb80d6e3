"""Choosing a transport backend by capability, and what happens when one is not installed."""

from __future__ import annotations

import importlib.util

import pytest

import replica
from replica.backends import backend_class, choose_backend
from replica.errors import TransportError
from replica.transport import Locality, MemoryKind


def config(**kw):
    return replica.Config(token=b"backends-test", **kw)


def test_default_order_by_memory_and_locality():
    assert choose_backend(config(), MemoryKind.HOST, Locality.SAME_NODE) == "ucx"
    assert choose_backend(config(), MemoryKind.CUDA, Locality.SAME_NODE) == "ipc"  # within a node
    assert choose_backend(config(), MemoryKind.CUDA, Locality.REMOTE) == "ucx"  # IPC cannot leave the node


def test_shm_when_listed_takes_host_memory_within_the_node_only():
    shm_first = config(backends=("shm", "ipc", "ucx", "gloo"))
    assert choose_backend(shm_first, MemoryKind.HOST, Locality.SAME_NODE) == "shm"
    assert choose_backend(shm_first, MemoryKind.HOST, Locality.REMOTE) == "ucx"  # shared memory cannot leave it
    assert choose_backend(shm_first, MemoryKind.CUDA, Locality.REMOTE) == "ucx"
    assert choose_backend(config(backends=("ipc", "shm", "ucx")), MemoryKind.CUDA, Locality.SAME_NODE) == "ipc"


def test_uninstalled_ucxx_falls_back_instead_of_failing_later(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a))
    with pytest.raises(TransportError, match="ucxx is not installed"):
        backend_class("ucx")
    assert choose_backend(config(), MemoryKind.HOST, Locality.REMOTE) == "gloo"
    with pytest.raises(TransportError, match="no transport moves CUDA memory to a REMOTE peer"):
        choose_backend(config(), MemoryKind.CUDA, Locality.REMOTE)


def test_verify_threads_reach_the_backend_and_bad_values_are_refused():
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="verify_threads"):
            config(verify_threads=bad)
    from replica.backends import make_backend

    with make_backend("gloo", config(verify_threads=3)) as transport:
        assert transport.config.verify_threads == 3
