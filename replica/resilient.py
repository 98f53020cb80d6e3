"""``ResilientProcessGroup``: a process group whose members can change while
FSDP2 keeps using it.

FSDP2 caches the group object (resolved by name from its device mesh), so a
failover cannot hand it a new one; this group stays, and what is inside it is
rebuilt: each *generation* is an inner gloo group (NCCL for CUDA tensors, not
tested here) made from a fresh store prefix, with a promoted standby at the
dead rank's index. When a member dies, the collectives of the step in flight
do not raise: the group records the error, finishes the step's remaining
collectives at once without communicating (their outputs are garbage), and
``errored`` says so. The step is then discarded (``Replicator.rollback``), the
group re-configured, and the step redone, so a survivor never hangs in, nor
unwinds out of, FSDP's hooks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from replica.errors import ReplicaError

__all__ = ["BACKEND_NAME", "ResilientProcessGroup", "init_resilient_process_group"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "replica"
_registered = threading.Lock()
_is_registered = False

# ProcessGroup-level collective -> method of the inner backend.
_FORWARD = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "_allgather_base": "_allgather_base",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "alltoall": "alltoall",
    "barrier": "barrier",
    "broadcast": "broadcast",
    "gather": "gather",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
}


class _Work(dist.Work):
    """Waits for the inner work; a failure is recorded on the group instead of raised."""

    def __init__(self, group: ResilientProcessGroup, inner: dist.Work | None, generation: int):
        super().__init__()
        self._group = group
        self._inner = inner
        self._generation = generation

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._inner is not None:
            inner, self._inner = self._inner, None
            try:
                inner.wait()
            except Exception as exc:  # noqa: BLE001 - a dead peer; the step will be redone
                self._group._record(exc, self._generation)
        return True

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([])
        return future


def _device_type(args: tuple) -> str:
    """The device of a collective's tensors (its first tensor argument, lists included)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, list | tuple) and arg:
            found = _device_type(tuple(arg))
            if found:
                return found
    return ""


def _forward(name: str, target: str):
    def collective(self: ResilientProcessGroup, *args):
        if self.on_collective is not None:
            self.on_collective(name)
        with self._lock:
            inners, generation = self._inners, self._generation
        inner = inners.get(_device_type(args) or "cpu", inners.get("cpu")) if inners else None
        if inner is None or self._error is not None:
            if self._error is None:
                self._record(ReplicaError("collective on a process group with no members configured"), generation)
            return _Work(self, None, generation)
        try:
            work = getattr(inner, target)(*args)
        except Exception as exc:  # noqa: BLE001 - posting fails the same way when a peer is gone
            self._record(exc, generation)
            return _Work(self, None, generation)
        return _Work(self, work, generation)

    collective.__name__ = name
    return collective


class ResilientProcessGroup(dist.ProcessGroup):
    """See the module docstring. Create it with ``init_resilient_process_group``."""

    def __init__(self, *, store: dist.Store, rank: int, world_size: int, timeout: timedelta, name: str,
                 cuda: bool | None = None):
        super().__init__(rank, world_size)
        self._store = store
        self._timeout = timeout
        self._name = name
        # CUDA tensors go through NCCL (built per generation too); None: when this machine has a GPU.
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._lock = threading.Lock()
        self._inners: dict[str, object] = {}  # device type -> the generation's inner backend
        self._generation = -1
        self._error: Exception | None = None
        self.on_collective: Callable[[str], None] | None = None  # called with each collective's name (tests)

    @property
    def group_name(self) -> str:  # the base class keeps no name for Python subclasses
        return self._name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def errored(self) -> Exception | None:
        """The first failure seen in the current generation (None while healthy)."""
        return self._error

    def configure(self, generation: int, *, timeout: timedelta | None = None) -> None:
        """Connect generation ``generation``: every member calls this with the same
        number (the coordinator's); blocks until all have joined or ``timeout``."""
        if generation <= self._generation:
            raise ValueError(f"generation {generation} is not newer than {self._generation}")
        timeout = timeout or self._timeout
        prefix = dist.PrefixStore(f"generation/{generation}", self._store)
        inners = {"cpu": dist.ProcessGroupGloo(prefix, self.rank(), self.size(), timeout)}
        if self.cuda:
            inners["cuda"] = _nccl(dist.PrefixStore("nccl", prefix), self.rank(), self.size(), timeout)
        with self._lock:
            old, self._inners, self._generation, self._error = self._inners, inners, generation, None
        for inner in old.values():
            _shutdown(inner)
        logger.info("[rank %d] process group generation %d connected (%s)", self.rank(), generation,
                    ", ".join(sorted(inners)))

    def abort(self, reason: str) -> None:
        """Fail the current generation now: a survivor blocked in an NCCL collective
        with a dead peer gets out (gloo's own timeout and closed connections do it for
        CPU tensors). The step is then redone in the next generation."""
        with self._lock:
            inners, generation = dict(self._inners), self._generation
        self._record(ReplicaError(f"generation {generation} aborted: {reason}"), generation)
        for device, inner in inners.items():
            if device != "cpu" and hasattr(inner, "abort"):
                try:
                    inner.abort()
                except Exception as exc:  # noqa: BLE001 - an already broken communicator
                    logger.debug("aborting generation %d's %s backend: %s", generation, device, exc)

    def _record(self, exc: Exception, generation: int) -> None:
        with self._lock:
            if generation == self._generation and self._error is None:
                self._error = exc
                logger.warning("[rank %d] generation %d failed: %s", self.rank(), generation, exc)

    def shutdown(self) -> None:
        with self._lock:
            inners, self._inners = self._inners, {}
        for inner in inners.values():
            _shutdown(inner)

    for _name, _target in _FORWARD.items():
        locals()[_name] = _forward(_name, _target)
    del _name, _target


def _shutdown(inner) -> None:
    try:
        inner.shutdown()
    except Exception as exc:  # noqa: BLE001 - a broken generation may not shut down cleanly
        logger.debug("shutting down an old generation: %s", exc)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta):
    """An NCCL group for one generation (not run on a GPU yet: see the README)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _create(opts, _backend_options) -> ResilientProcessGroup:
    return ResilientProcessGroup(store=opts.store, rank=opts.group_rank, world_size=opts.group_size,
                                 timeout=opts.timeout, name=opts.group_id)


def init_resilient_process_group(*, store: dist.Store, rank: int, world_size: int,
                                 timeout: timedelta = timedelta(seconds=30),
                                 generation: int | None = 0) -> ResilientProcessGroup:
    """Initialize torch.distributed's default group as a ResilientProcessGroup and
    connect ``generation`` (None: build it unconnected, as a standby does, which
    may build its FSDP2 model before it joins)."""
    global _is_registered
    with _registered:
        if not _is_registered:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
            _is_registered = True
    dist.init_process_group(BACKEND_NAME, store=dist.PrefixStore("replica/pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    if not isinstance(group, ResilientProcessGroup):
        raise ReplicaError(f"the default group is a {type(group).__name__}, not a ResilientProcessGroup")
    if generation is not None:
        group.configure(generation)
    return group
