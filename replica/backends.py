"""Which ``replica.transport`` backend a mirror uses, chosen by capability.

Backends are imported only when chosen: UCX loads libucx, IPC needs CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress

import torch

from replica.config import Config
from replica.errors import TransportError
from replica.transport import Locality, MemoryKind, Transport, select_transport, shm

__all__ = ["SHM_BACKEND", "backend_class", "choose_backend", "locality_of", "make_backend", "transfer_buffer"]

#: The backend that sends host buffers in shared memory where they lie (``Snapshot(shared=True)``).
SHM_BACKEND = "shm"

# name -> (module, transport class, config class, the package it needs at run time)
_BACKENDS = {
    "ucx": ("replica.transport.ucx", "UcxTransport", "UcxConfig", "ucxx"),
    "gloo": ("replica.transport.gloo", "GlooTransport", "GlooConfig", None),
    "ipc": ("replica.transport.ipc", "IpcTransport", "IpcConfig", None),
    SHM_BACKEND: ("replica.transport.ipc", "ShmTransport", "IpcConfig", None),
}


def _load(name: str) -> tuple[type[Transport], type]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transport backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    module, transport, config, needs = _BACKENDS[name]
    # The UCX module loads ucxx only when a transport is built: without this check a machine
    # without it (ucxx is an extra: replica[cu12] / replica[cu13]) would choose UCX and fail later.
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise TransportError(f"transport backend {name!r} is not available: {needs} is not installed "
                             f"(pip install 'replica[cu12]' or 'replica[cu13]', matching torch.version.cuda)")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise TransportError(f"transport backend {name!r} is not available: {exc}") from exc
    return getattr(mod, transport), getattr(mod, config)


def backend_class(name: str) -> type[Transport]:
    return _load(name)[0]


def locality_of(host: str) -> Locality:
    """SAME_NODE for a loopback address (peers of a loopback listener are local)."""
    try:
        return Locality.SAME_NODE if ipaddress.ip_address(host).is_loopback else Locality.REMOTE
    except ValueError:
        return Locality.SAME_NODE if host == "localhost" else Locality.REMOTE


def choose_backend(config: Config, memory: MemoryKind, locality: Locality) -> str:
    """The first of ``config.backends`` that is installed and can move ``memory`` to ``locality``."""
    available = {}
    errors = []
    for name in config.backends:
        try:
            available[backend_class(name)] = name
        except TransportError as exc:
            errors.append(str(exc))
    if not available:
        raise TransportError("no transport backend is available: " + "; ".join(errors))
    return available[select_transport(list(available), memory, locality)]


def make_backend(name: str, config: Config) -> Transport:
    transport, backend_config = _load(name)
    return transport(backend_config(token=config.token, host=config.host, verify=config.verify,
                                    verify_threads=config.verify_threads))


def transfer_buffer(nbytes: int, *, device: torch.device | str = "cpu", pin_memory: bool = False,
                    shared: bool = False) -> torch.Tensor:
    """A zeroed uint8 buffer of ``nbytes`` on ``device`` that a backend sends from or
    receives into. On the host: pinned when ``pin_memory`` asks and CUDA is present
    (copies to and from a GPU then run asynchronously), else in shared memory when
    ``shared`` asks (the shm backend offers its buckets where they lie), else plain."""
    device = torch.device(device)
    if device.type == "cpu" and pin_memory and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    if device.type == "cpu" and shared:
        return shm.shared_empty(nbytes)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
