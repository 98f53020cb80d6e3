"""Which ``replica.transport`` backend a mirror uses, chosen by capability.

Backends are imported only when chosen: UCX loads libucx, IPC needs CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

from replica import envvars
from replica.config import Config
from replica.errors import SharedMemoryUnavailableError, TransportError
from replica.transport import Connection, Locality, MemoryKind, Transport, select_transport

if TYPE_CHECKING:
    from replica.jobstore import Registration

__all__ = [
    "BACKENDS",
    "NIXL_BACKEND",
    "NixlOptions",
    "SHM_BACKEND",
    "backend_class",
    "backend_name",
    "check_backends",
    "choose_backend",
    "choose_backends",
    "connect",
    "locality_of",
    "make_backend",
    "nixl_options",
    "parse_backends",
]

logger = logging.getLogger(__name__)

#: The backend that sends host buffers in shared memory where they lie (``Snapshot(shared=True)``).
SHM_BACKEND = "shm"

#: The backend over NVIDIA's NIXL (``replica.transport.nixl``).
NIXL_BACKEND = "nixl"

# name -> (module, transport class, config class, the package it needs at run time, how to install it)
_UCX_HINT = "pip install 'replica[cu12]' or 'replica[cu13]', matching torch.version.cuda"
_BACKENDS = {
    "ucx": ("replica.transport.ucx", "UcxTransport", "UcxConfig", "ucxx", _UCX_HINT),
    "gloo": ("replica.transport.gloo", "GlooTransport", "GlooConfig", None, ""),
    "ipc": ("replica.transport.ipc", "IpcTransport", "IpcConfig", None, ""),
    SHM_BACKEND: ("replica.transport.shm", "ShmTransport", "IpcConfig", None, ""),
    NIXL_BACKEND: ("replica.transport.nixl", "NixlTransport", "NixlConfig", "nixl", "pip install 'replica[nixl]'"),
}


class _BackendClass(Protocol):
    """A backend's ``Transport`` subclass as ``make_backend`` builds it: from its config alone."""

    def __call__(self, config: Any, /) -> Transport: ...


class NixlOptions(TypedDict, total=False):
    """``NixlConfig``'s fields that the environment sets (``nixl_options``)."""

    plugin: str
    plugin_params: tuple[tuple[str, str], ...]


#: Every backend's name, as ``Config.backends`` lists them.
BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def parse_backends(text: str) -> tuple[str, ...]:
    """``Config.backends`` from a comma-separated list ("ucx,gloo"); () for "" (Config's default).
    ValueError naming an unknown backend."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in _BACKENDS]
    if unknown:
        raise ValueError(f"unknown transport backend(s) {', '.join(map(repr, unknown))}; known: {', '.join(BACKENDS)}")
    return names


def _load(name: str) -> tuple[type[Transport], type]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transport backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    module, transport, config, needs, hint = _BACKENDS[name]
    # The UCX and NIXL modules load their library only when a transport is built: without this
    # check a machine without it (each is an extra) would choose the backend and fail later.
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise TransportError(f"transport backend {name!r} is not available: {needs} is not installed ({hint})")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise TransportError(f"transport backend {name!r} is not available: {exc}") from exc
    return getattr(mod, transport), getattr(mod, config)


def backend_class(name: str) -> type[Transport]:
    return _load(name)[0]


def backend_name(transport: Transport) -> str:
    """The name ``transport``'s backend goes by in ``Config.backends``."""
    kind = type(transport)
    for name, (module, cls, *_) in _BACKENDS.items():
        if (kind.__module__, kind.__name__) == (module, cls):
            return name
    raise ValueError(f"{kind.__name__} is not one of replica's transport backends")


def locality_of(host: str) -> Locality:
    """SAME_NODE for a loopback address (peers of a loopback listener are local)."""
    try:
        return Locality.SAME_NODE if ipaddress.ip_address(host).is_loopback else Locality.REMOTE
    except ValueError:
        return Locality.SAME_NODE if host == "localhost" else Locality.REMOTE


def _first_fit(names: Sequence[str], memory: MemoryKind, locality: Locality) -> str:
    available = {}
    errors = []
    for name in names:
        try:
            available[backend_class(name)] = name
        except TransportError as exc:
            errors.append(str(exc))
    if not available:
        raise TransportError("no transport backend is available: " + "; ".join(errors))
    return available[select_transport(list(available), memory, locality)]


def choose_backend(config: Config, memory: MemoryKind, locality: Locality) -> str:
    """The first of ``config.backends`` that is installed and can move ``memory`` to ``locality``."""
    return _first_fit(config.backends, memory, locality)


def choose_backends(config: Config, memory: MemoryKind, locality: Locality) -> tuple[str, str | None]:
    """What a listener listens on: ``choose_backend``'s choice and, when that is the shm
    backend (which refuses a peer of another user or PID namespace, something no
    listener can know in advance), the next of ``config.backends`` that fits, for the
    peers it refuses (None when none fits or the choice refuses no one)."""
    backend = choose_backend(config, memory, locality)
    if backend != SHM_BACKEND:
        return backend, None
    rest = [name for name in config.backends if name != SHM_BACKEND]
    try:
        return backend, _first_fit(rest, memory, locality) if rest else None
    except TransportError:
        return backend, None


def connect(
    registration: Registration, memory: MemoryKind, config: Config, *, peer: str
) -> tuple[Transport, Connection]:
    """A connection to the listener of ``registration`` for ``memory``: over its backend or,
    when that refuses this process (``SharedMemoryUnavailableError``), over its fallback,
    with a warning saying why. Returns the transport too (the caller closes it); nothing
    stays open when this raises."""
    endpoints = registration.endpoints()
    share_memory = True
    for (backend, address), (fallback, _) in zip(endpoints, endpoints[1:], strict=False):
        try:
            return _connect_to(backend, address, memory, config, peer, share_memory)
        except SharedMemoryUnavailableError as exc:
            logger.warning("%s: %s; connecting over %s instead", peer, exc, fallback)
            share_memory = False  # nor can the fallback's own shared-memory paths reach it
    return _connect_to(*endpoints[-1], memory, config, peer, share_memory)


def _connect_to(
    backend: str, address: str, memory: MemoryKind, config: Config, peer: str, share_memory: bool
) -> tuple[Transport, Connection]:
    if memory not in backend_class(backend).capabilities.memory:
        raise TransportError(f"{peer} listens on {backend}, which cannot move {memory.name} memory")
    transport = make_backend(backend, config, share_memory=share_memory)
    try:
        return transport, transport.connect(address, config.timeout)
    except BaseException:
        transport.close()
        raise


def make_backend(name: str, config: Config, *, share_memory: bool = True) -> Transport:
    """Backend ``name`` set up from ``config``. ``share_memory=False``: for a peer that cannot
    map this process's memory though it runs on this host (a backend that would reach it
    through shared memory, UCX, takes the way it takes to another host instead)."""
    transport, backend_config = _load(name)
    # (each backend's Transport takes its config, UcxTransport(UcxConfig) ...: the base class declares no __init__)
    build = cast(_BackendClass, transport)
    options: dict[str, object] = (
        {} if share_memory or "share_memory" not in backend_config.__dataclass_fields__ else {"share_memory": False}
    )
    if name == NIXL_BACKEND:
        options.update(nixl_options())
    return build(
        backend_config(
            token=config.token, host=config.host, verify=config.verify, verify_threads=config.verify_threads, **options
        )
    )


def nixl_options(environ: Mapping[str, str] | None = None) -> NixlOptions:
    """The NIXL plugin and its parameters from the environment (``REPLICA_NIXL_BACKEND``,
    default UCX; ``REPLICA_NIXL_PARAMS``, ``name=value`` pairs separated by commas).
    ValueError for a malformed value."""
    env = os.environ if environ is None else environ
    options: NixlOptions = {}
    plugin = env.get(envvars.NIXL_BACKEND, "").strip()
    if plugin:
        options["plugin"] = plugin
    params = []
    for item in filter(None, (part.strip() for part in env.get(envvars.NIXL_PARAMS, "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{envvars.NIXL_PARAMS} holds name=value pairs separated by commas, got {item!r}")
        params.append((key.strip(), value.strip()))
    if params:
        options["plugin_params"] = tuple(params)
    return options


def check_backends(names: Sequence[str]) -> None:
    """Refuse, before anything starts, backends named explicitly that cannot work here:
    NIXL not installed, or without the plugin ``REPLICA_NIXL_BACKEND`` names (this also
    starts this process's NIXL agent, off any failover's path). TransportError or
    ValueError saying why."""
    if NIXL_BACKEND in names:
        _load(NIXL_BACKEND)
        from replica.transport.nixl import NixlConfig
        from replica.transport.nixl_agent import shared_agent

        config = NixlConfig(token=b"check", **nixl_options())
        shared_agent(config.plugin, config.plugin_params, config.progress_wakeup)
