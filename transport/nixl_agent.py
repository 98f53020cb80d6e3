"""One NIXL agent per process and NIXL backend plugin, made once and shared by every
connection of the ``"nixl"`` transport (``replica.transport.nixl``).

An agent costs hundreds of milliseconds to make (its plugin's start: UCX's context
and worker), so it is never made on a failover's path: ``shared_agent`` makes it at
the first call, which the transport's constructor is (a standby or a trainer builds
its transport when it starts, long before a failover needs it), and every later
connection reuses it. A connection then only loads its peer's metadata (tens of
milliseconds, measured in docs/transports.md).

Memory is registered once per tensor storage, not per bucket: a storage is registered
whole the first time a send or a receive touches any part of it, and stays registered
while the process keeps it (a standby's receive buffer, a trainer's snapshots: every
step's buckets reuse one registration). A registration holds its storage, so the memory
cannot be freed and reused while NIXL may still write into it; once no transfer uses it
and nothing but the registration holds the storage, it is deregistered and the memory
goes back; past ``MAX_REGIONS`` registrations, idle ones go too, least recently used first.

NIXL's Python agent is not safe to call from several threads at once: every call
here holds the agent's lock.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import itertools
import logging
import os
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from replica.errors import TransportError

__all__ = [
    "Agent",
    "DEFAULT_PLUGIN",
    "MAX_REGIONS",
    "PROGRESS_WAKEUP",
    "Region",
    "check_plugin_name",
    "nixl_installed",
    "shared_agent",
]

logger = logging.getLogger(__name__)

#: The NIXL backend plugin a transport uses unless configured otherwise.
DEFAULT_PLUGIN = "UCX"
#: How often an idle agent's progress thread wakes (it wakes at once for work); NIXL's
#: UCX plugin rounds it up to whole milliseconds.
PROGRESS_WAKEUP = timedelta(milliseconds=1)
#: Registered storages kept at most (beyond this, idle ones are deregistered, oldest first).
MAX_REGIONS = 64
_PLUGIN_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_INSTALL_HINT = "pip install 'replica[nixl]'"


def _modules() -> tuple[Any, Any]:
    """NIXL's ``_api`` and ``_bindings`` modules: through the ``nixl`` package (which picks
    the build for this machine's CUDA), else whichever build is installed."""
    errors = []
    for package in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(f"{package}._api"), importlib.import_module(f"{package}._bindings")
        except ImportError as exc:
            errors.append(f"{package}: {exc}")
    raise TransportError(
        f"the nixl transport backend needs NIXL, which is not installed ({_INSTALL_HINT}): " + "; ".join(errors)
    )


def nixl_installed() -> bool:
    """Whether NIXL's Python API can be found (without loading it)."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13", "nixl_cu12"))


def check_plugin_name(name: object) -> None:
    """ValueError unless ``name`` can name a NIXL backend plugin ("UCX", "LIBFABRIC", ...)."""
    if not isinstance(name, str) or not _PLUGIN_NAME.match(name):
        raise ValueError(f"a NIXL backend is named in capitals, like 'UCX' or 'LIBFABRIC'; got {name!r}")


@dataclass(eq=False)
class Region:
    """One registered storage: its registration, and what a peer needs to write into it."""

    id: int
    base: int
    nbytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device: int
    descs: Any  # the nixlRegDList to deregister
    keep: Any  # the storage, alive while registered
    metadata: bytes  # the partial agent metadata naming this registration
    uses: int = 0

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.nbytes


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _only_ours(storage: Any) -> bool:
    """Whether nothing but a registration holds ``storage`` (no tensor of the process is
    left on it). False where torch cannot say: the storage then stays until evicted."""
    return _use_count is not None and _use_count(storage._cdata) <= 1


def _where(flat: torch.Tensor) -> tuple[str, int]:
    if flat.device.type == "cuda":
        return "VRAM", flat.device.index if flat.device.index is not None else torch.cuda.current_device()
    if flat.device.type == "cpu":
        return "DRAM", 0
    raise TransportError(f"NIXL cannot move memory on {flat.device}")


def _other_ucx_loaded() -> bool:
    """Whether a UCX other than NIXL's own (ucxx's ``libucx`` package) is mapped in this process."""
    try:
        with open("/proc/self/maps") as maps:
            return any("/libucx/lib/libucp" in line for line in maps)
    except OSError:
        return False


def _sleeping_agent(api: Any, bindings: Any, name: str, wakeup: timedelta) -> Any:
    """``nixl_agent(name)`` whose progress thread sleeps in poll() and wakes at least every
    ``wakeup``. NIXL's Python API makes its agent with a delay of 0, a poll() that never
    sleeps: one core per process burnt while idle, which a trainer sharing its cores
    cannot spare (measured: 0.99 s of CPU per idle second against 0.01, and 512 MiB
    written at 5.2 GB/s against 4.0 on two cores). The API sets no other delay, so the
    delay is set where it builds the agent's config (under ``_agents_lock``)."""
    real = bindings.nixlAgent

    def build(agent_name: str, config: Any) -> Any:
        config.pthrDelay = max(1, round(wakeup / timedelta(microseconds=1)))
        return real(agent_name, config)

    bindings.nixlAgent = build
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    finally:
        bindings.nixlAgent = real


@dataclass(eq=False)
class Agent:
    """This process's NIXL agent for one plugin (use ``shared_agent``)."""

    plugin: str
    name: str
    _agent: Any
    _bindings: Any
    mem_types: tuple[str, ...]
    connection_info: bytes  # what a peer loads to reach this agent (no memory in it)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _regions: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _remotes: collections.Counter = field(default_factory=collections.Counter)
    _made: int = 0

    @classmethod
    def start(cls, plugin: str, params: dict[str, str], wakeup: timedelta = PROGRESS_WAKEUP) -> Agent:
        check_plugin_name(plugin)
        api, bindings = _modules()
        name = f"replica-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # No plugin at construction: NIXL only logs a plugin it cannot find; this says so.
        agent = _sleeping_agent(api, bindings, name, wakeup)
        available = sorted(agent.get_plugin_list())
        if plugin not in available:
            raise TransportError(f"NIXL has no backend {plugin!r}; this installation has {', '.join(available)}")
        try:
            agent.create_backend(plugin, dict(params))
        except Exception as exc:  # NIXL's own error types: say which plugin, and with what
            raise TransportError(f"NIXL could not start its {plugin} backend with {dict(params)}: {exc}") from exc
        mem_types = tuple(t.removesuffix("_SEG") for t in agent.get_backend_mem_types(plugin))
        if plugin == "UCX" and _other_ucx_loaded():
            logger.warning(
                "NIXL shares this process with another UCX (ucxx's libucx, loaded first): NIXL's UCX "
                "then cannot use its shared-memory paths and falls back to slower ones (measured here: "
                "0.75 GB/s instead of 4.7). Use one of the two per process (--backends nixl,gloo)."
            )
        info = agent.get_partial_agent_metadata(bindings.nixlRegDList(bindings.DRAM_SEG), True, [plugin])
        logger.info("NIXL agent %s started with its %s backend (memory: %s)", name, plugin, ", ".join(mem_types))
        return cls(
            plugin=plugin, name=name, _agent=agent, _bindings=bindings, mem_types=mem_types, connection_info=bytes(info)
        )

    # --- peers ---

    def add_peer(self, connection_info: bytes) -> str:
        """Load a peer's connection info; returns its agent name. Counted: ``drop_peer``
        forgets the peer once every connection that added it dropped it. This process's own
        agent (two transports of one process connected) is not loaded: NIXL writes to itself."""
        if connection_info == self.connection_info:
            return self.name
        with self._lock:
            try:
                name = self._agent.add_remote_agent(connection_info)
            except Exception as exc:
                raise TransportError(f"NIXL could not load the peer's metadata: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] += 1
            return name

    def load(self, peer: str, metadata: bytes) -> None:
        """Load ``peer``'s metadata about memory it registered (``Region.metadata``)."""
        if peer == self.name:
            return
        with self._lock:
            try:
                self._agent.add_remote_agent(metadata)
            except Exception as exc:
                # NIXL keeps a peer's metadata for memory the peer has deregistered since (it
                # cannot forget one registration), and refuses a new key for the very same range
                # (NIXL_ERR_NOT_ALLOWED). Where keys are per registration (RDMA), a new buffer
                # at a freed one's address would hit it: this connection ends, loudly, and the
                # next one (its peer loaded afresh once no connection holds it) starts clean.
                raise TransportError(f"NIXL refused {peer}'s metadata for a new registration: {exc}") from exc

    def drop_peer(self, name: str) -> None:
        if name == self.name:
            return
        with self._lock:
            self._remotes[name] -= 1
            if self._remotes[name] > 0:
                return
            del self._remotes[name]
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - a peer that is gone may be gone from NIXL too
                logger.debug("NIXL: forgetting agent %s: %s", name, exc)

    # --- memory ---

    def use(self, flat: torch.Tensor) -> Region:
        """The registration covering ``flat`` (its storage's, made if none), counted as in use."""
        mem_type, device = _where(flat)
        if mem_type not in self.mem_types:
            raise TransportError(
                f"NIXL's {self.plugin} backend cannot move {mem_type} memory (it moves {', '.join(self.mem_types)})"
            )
        storage = flat.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            for region in reversed(self._regions.values()):
                if (
                    region.mem_type == mem_type
                    and region.device == device
                    and region.contains(flat.data_ptr(), flat.numel())
                ):
                    self._regions.move_to_end(region.id)
                    region.uses += 1
                    return region
            try:
                descs = self._agent.register_memory([(base, nbytes, device, "")], mem_type, [self.plugin])
                metadata = self._agent.get_partial_agent_metadata(descs, False, [self.plugin])
            except Exception as exc:
                raise TransportError(f"NIXL could not register {nbytes} bytes of {mem_type}: {exc}") from exc
            self._made += 1
            region = Region(
                id=next(self._ids),
                base=base,
                nbytes=nbytes,
                mem_type=mem_type,
                device=device,
                descs=descs,
                keep=storage,
                metadata=bytes(metadata),
                uses=1,
            )
            self._regions[region.id] = region
            self._evict()
            return region

    def done_with(self, region: Region) -> None:
        with self._lock:
            region.uses -= 1
            self._evict()

    def release_idle(self) -> None:
        """Deregister now what ``done_with`` would at its next call (storages nothing else holds)."""
        with self._lock:
            self._evict()

    def _evict(self) -> None:
        """Deregister idle storages nothing else holds, then idle ones, oldest first, while
        more than MAX_REGIONS are held."""
        idle = [r for r in self._regions.values() if r.uses == 0]
        orphans = [r for r in idle if _only_ours(r.keep)]
        excess = len(self._regions) - len(orphans) - MAX_REGIONS
        rest = [r for r in idle if r not in orphans][: max(excess, 0)]
        for region in orphans + rest:
            del self._regions[region.id]
            try:
                self._agent.deregister_memory(region.descs, [self.plugin])
            except Exception as exc:  # noqa: BLE001 - the storage is dropped either way
                logger.warning("NIXL: deregistering %d bytes failed: %s", region.nbytes, exc)

    @property
    def registered(self) -> int:
        """Storages registered now."""
        with self._lock:
            return len(self._regions)

    @property
    def registrations(self) -> int:
        """Registrations made so far (each storage once while it stays registered)."""
        with self._lock:
            return self._made

    # --- transfers ---

    def write(self, flat: torch.Tensor, peer: str, addr: int, mem_type: str, device: int) -> Any:
        """Post a one-sided write of ``flat`` (inside a region this process uses) to
        ``addr`` in the peer's registered memory; returns the handle ``state`` polls."""
        local_type, local_device = _where(flat)
        with self._lock:
            local = self._agent.get_xfer_descs([(flat.data_ptr(), flat.numel(), local_device)], local_type)
            remote = self._agent.get_xfer_descs([(addr, flat.numel(), device)], mem_type)
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer, b"", [self.plugin])
            try:
                if self._agent.transfer(handle) == "ERR":
                    raise TransportError(f"NIXL refused a write of {flat.numel()} bytes to {peer}")
            except BaseException:
                self._release(handle)
                raise
            return handle

    def state(self, handle: Any) -> str:
        """ "DONE" (the bytes are in the peer's memory: NIXL's UCX backend flushes before
        it says so), "PROC" or "ERR"."""
        with self._lock:
            return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        with self._lock:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - one still active: NIXL keeps it, and so does GC
            logger.debug("NIXL: releasing a transfer: %s", exc)


_agents: dict[tuple[str, tuple[tuple[str, str], ...], timedelta], Agent] = {}
_agents_lock = threading.Lock()


def shared_agent(
    plugin: str = DEFAULT_PLUGIN, params: tuple[tuple[str, str], ...] = (), wakeup: timedelta = PROGRESS_WAKEUP
) -> Agent:
    """This process's agent for ``plugin`` with ``params``, made at the first call.
    TransportError, saying what is there, when NIXL is missing or has no such plugin."""
    key = (plugin, tuple(sorted(params)), wakeup)
    with _agents_lock:
        agent = _agents.get(key)
        if agent is None:
            agent = _agents[key] = Agent.start(plugin, dict(params), wakeup)
        return agent
