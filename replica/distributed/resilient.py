"""``ResilientProcessGroup``: a process group whose members can change while
FSDP2 keeps using it.

FSDP2 caches the group object (resolved by name from its device mesh), so a
failover cannot hand it a new one; this group stays, and what is inside it is
rebuilt: each *generation* is an inner gloo group, plus an NCCL group for CUDA
tensors where there is a GPU, made from a fresh store prefix, with a promoted
standby at the dead rank's index. When a member dies, the collectives of the
step in flight do not raise: the group records the error, finishes the step's
remaining collectives at once without communicating (their outputs are
garbage), and ``errored`` says so. The step is then discarded
(``Replicator.rollback``), the group re-configured, and the step redone, so a
survivor never hangs in, nor unwinds out of, FSDP's hooks.

NCCL reports failures asynchronously: its ``wait()`` only orders streams, and
a collective whose peer died spins on the GPU until its communicator is
aborted (by ``abort()`` when the coordinator announces the failover, or by
NCCL's watchdog at ``nccl_timeout``). So after a step's work has been
synchronized, ``check()`` polls the generation's NCCL collectives and
records a failure they report; ``errored`` alone is a plain read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from replica.distributed.works import (
    REDUCE_SCATTERS,
    GroupWork,
    allreduce_scattered,
    backend_failure,
    device_type,
    work_status,
)
from replica.errors import ReplicaError
from replica.timing import Deadline, pause

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

# Unfinished NCCL works kept per generation before the finished ones are dropped.
_MAX_TRACKED_WORKS = 1024
_ARRIVE_POLL = timedelta(milliseconds=10)  # how often a connecting member looks for the others' arrival


def _forward(name: str, target: str):
    def collective(self: ResilientProcessGroup, *args, **kwargs):  # barrier(opts=...) comes as a keyword
        if self.on_collective is not None:
            self.on_collective(name)
        device = device_type((*args, *kwargs.values())) or "cpu"
        with self._lock:
            inners, generation = self._inners, self._generation
        inner = inners.get(device, inners.get("cpu")) if inners else None
        if inner is None or self._error is not None:
            if self._error is None and not self._rehearsing:
                self._record(ReplicaError("collective on a process group with no members configured"), generation)
            return GroupWork(self, None, generation)
        then = None
        try:
            if device == "cpu" and target in REDUCE_SCATTERS:
                work, then = allreduce_scattered(inner, target, self.rank(), self.size(), args, kwargs)
            else:
                work = getattr(inner, target)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - posting fails the same way when a peer is gone
            self._record(exc, generation)
            return GroupWork(self, None, generation)
        if device != "cpu":
            self._track(work, generation)
        return GroupWork(self, work, generation, gloo=device == "cpu", then=then)

    collective.__name__ = name
    return collective


class ResilientProcessGroup(dist.ProcessGroup):
    """See the module docstring. Create it with ``init_resilient_process_group``.

    ``timeout`` bounds gloo's collectives (a frozen peer fails one at it) and the
    joining of a generation; ``nccl_timeout`` is NCCL's watchdog timeout, which
    must stay well above the coordinator's heartbeat deadline: the coordinator,
    not the watchdog, decides who is dead (default: 3x ``timeout``).
    """

    def __init__(
        self,
        *,
        store: Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        name: str,
        cuda: bool | None = None,
        nccl_timeout: timedelta | None = None,
    ):
        # (the binding also takes (rank, size), for a Python subclass; torch's stub lists only (store, rank, size))
        super().__init__(rank, world_size)  # pyright: ignore[reportCallIssue]
        self._store = store
        self._timeout = timeout
        self.nccl_timeout = nccl_timeout if nccl_timeout is not None else 3 * timeout
        self._name = name
        # CUDA tensors go through NCCL (built per generation too); None: when this machine has a GPU.
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._lock = threading.Lock()
        self._inners: dict[str, object] = {}  # device type -> the generation's inner backend
        self._generation = -1
        self._error: Exception | None = None
        self._works: deque = deque()  # the generation's NCCL works not yet seen finished
        self._aborts: list[threading.Event] = []  # set once an old generation's NCCL abort() returned
        self._aborted = -1  # the last generation whose NCCL backend abort() was started for
        self._drops: list[threading.Thread] = []  # old generations' gloo groups being dropped
        self.on_collective: Callable[[str], None] | None = None  # called with each collective's name (tests)
        self._rehearsing = False

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
        """The first failure recorded in the current generation (None while healthy).
        A plain read (safe from any thread); see ``check()`` for NCCL."""
        return self._error

    def check(self) -> Exception | None:
        """Poll the current generation's NCCL collectives for a failure (a dead
        peer's communicator error, a watchdog timeout, an abort) and record it;
        returns ``errored``. Call it after synchronizing a step's CUDA work, before
        trusting its result. Never blocks (CUDA event queries only), but call it
        from the training thread, not from a heartbeat."""
        with self._lock:
            if self._error is not None:
                return self._error
            generation, inners, works = self._generation, dict(self._inners), list(self._works)
        finished = set()
        for work in works:
            done, failure = work_status(work)
            if failure is not None:
                self._record(failure, generation)
                break
            if done:
                finished.add(id(work))
        for device, inner in inners.items():
            failure = backend_failure(inner) if device != "cpu" else None
            if failure is not None:
                self._record(failure, generation)
        with self._lock:
            if generation == self._generation and finished:
                self._works = deque(w for w in self._works if id(w) not in finished)
        return self._error

    @property
    def rehearsing(self) -> bool:
        """Whether a ``rehearsal`` runs now."""
        return self._rehearsing

    @contextlib.contextmanager
    def rehearsal(self) -> Iterator[None]:
        """While in it, collectives complete at once without communicating, their outputs
        left as they were (garbage), and no failure is recorded: a member that is not
        connected yet (a standby) runs a step ahead of time, so that ``torch.compile`` and
        CUDA's first-step work are done before its promotion (``replica.mirror.warmup``).
        Refused on a connected group, and ``configure`` is refused inside it."""
        with self._lock:
            if self._inners or self._generation >= 0:
                raise ReplicaError(f"a rehearsal needs a group not connected yet; generation {self._generation} is")
            if self._rehearsing:
                raise ReplicaError("a rehearsal is already running")
            self._rehearsing = True
        try:
            yield
        finally:
            with self._lock:
                self._rehearsing = False

    def configure(
        self,
        generation: int,
        *,
        timeout: timedelta | None = None,
        ready_timeout: timedelta | None = None,
        ready_abort: Callable[[], bool] | None = None,
    ) -> None:
        """Connect generation ``generation``: every member calls this with the same
        number (the coordinator's); blocks until all have joined or ``timeout``.

        ``ready_timeout`` first waits (polling, up to that long) until every member
        has arrived, so a member that is slow to get here (a promoted standby
        restoring under load) is not failed by the short collective ``timeout``,
        which also bounds gloo's rendezvous. ``ready_abort()`` returning True ends
        that wait early with ReplicaError (the generation was superseded)."""
        if generation <= self._generation:
            raise ValueError(f"generation {generation} is not newer than {self._generation}")
        if self._rehearsing:
            raise ReplicaError(f"generation {generation} cannot be connected during a rehearsal")
        timeout = timeout or self._timeout
        prefix = PrefixStore(f"generation/{generation}", self._store)
        if ready_timeout is not None:
            self._arrive(prefix, generation, ready_timeout, ready_abort)
        inners: dict[str, object] = {"cpu": dist.ProcessGroupGloo(prefix, self.rank(), self.size(), timeout)}
        self._release(timeout, background=True)
        if self.cuda:
            inners["cuda"] = _nccl(PrefixStore("nccl", prefix), self.rank(), self.size(), self.nccl_timeout)
        with self._lock:
            self._inners, self._generation, self._error = inners, generation, None
            self._works = deque()
        logger.info(
            "[rank %d] process group generation %d connected (%s)", self.rank(), generation, ", ".join(sorted(inners))
        )

    def _arrive(self, prefix: Store, generation: int, timeout: timedelta, abort: Callable[[], bool] | None) -> None:
        # (torch's stub types values as str; the binding takes bytes)
        prefix.set(f"arrived/{self.rank()}", b"1")  # pyright: ignore[reportArgumentType]
        names = [f"arrived/{r}" for r in range(self.size())]
        deadline = Deadline.after(timeout)
        while not prefix.check(names):  # polled: a blocking wait would hold the store client for everyone
            if abort is not None and abort():
                raise ReplicaError(f"generation {generation} was superseded before every member arrived")
            if deadline.expired:
                missing = [r for r in range(self.size()) if not prefix.check([f"arrived/{r}"])]
                raise ReplicaError(f"generation {generation}: ranks {missing} did not arrive within {timeout}")
            pause(_ARRIVE_POLL, deadline=deadline)

    def abort(self, reason: str, *, wait: timedelta = timedelta(0)) -> bool:
        """Fail the current generation now: ``errored`` is set before this returns,
        and the generation's NCCL communicators are aborted, so a survivor whose
        GPU spins in a collective with a dead peer gets out; a survivor waiting in a
        gloo collective stops waiting (otherwise only gloo's own timeout or a closed
        connection end it: a lost host closes none). The abort runs on a thread of
        its own (``ncclCommAbort`` may take a while, and the caller may be a
        heartbeat, which must never block); this waits for it at most ``wait``
        and returns whether it finished. The step is then redone in the next
        generation."""
        with self._lock:
            generation = self._generation
            # Once per generation: a second abort would only queue behind the first.
            nccl = [b for d, b in self._inners.items() if d != "cpu"] if generation != self._aborted else []
            if nccl:
                self._aborted = generation
        self._record(ReplicaError(f"generation {generation} aborted: {reason}"), generation)
        if nccl:
            self._abort_async(nccl, generation, abort=True)
        return self._join_aborts(wait, warn=False)

    def _release(self, timeout: timedelta, *, background: bool = False) -> None:
        """Take the current generation out: gloo shut down, NCCL aborted (never shut down
        gracefully: that flushes its collectives, which waits forever on a dead peer);
        waits for the aborts at most ``timeout``, so a new communicator is not made
        while an old one is being torn down. ``background`` (a new generation replaces
        it): gloo's destructor joins its threads, and so waits for a collective abandoned
        by an abort (its peer's host lost) until gloo's own timeout; it runs on a thread
        of its own then, which ``shutdown()`` waits for."""
        with self._lock:
            inners, generation, self._inners = self._inners, self._generation, {}
            self._works = deque()
            aborted = generation == self._aborted
            self._aborted = generation
        gloo = [inners.pop("cpu")] if "cpu" in inners else []
        self._abort_async(list(inners.values()), generation, abort=not aborted)
        del inners
        if gloo and background:
            drop = threading.Thread(
                target=_drop_gloo, args=(gloo,), daemon=True, name=f"replica-drop-gloo-{generation}"
            )
            drop.start()
            self._drops = [d for d in self._drops if d.is_alive()] + [drop]
        elif gloo:
            _drop_gloo(gloo)
        del gloo
        self._join_aborts(timeout)

    def _abort_async(self, inners: list, generation: int, *, abort: bool) -> None:
        """Abort ``inners`` (unless ``abort`` is False: already aborted) on a thread of
        their own, which also drops the last references to them."""
        if not inners:
            return

        aborted = threading.Event()

        def run() -> None:
            for inner in inners if abort else ():
                try:
                    inner.abort()
                except Exception as exc:  # noqa: BLE001 - an already broken communicator
                    logger.debug("aborting generation %d's NCCL backend: %s", generation, exc)
            aborted.set()
            # The last references: the backends' destructors run here, not on the training
            # thread (they join NCCL's watchdog, which may sleep a minute after a failure).
            inners.clear()

        with self._lock:
            self._aborts = [e for e in self._aborts if not e.is_set()] + [aborted]
        threading.Thread(target=run, daemon=True, name=f"replica-abort-{generation}").start()

    def _join_aborts(self, timeout: timedelta, *, warn: bool = True) -> bool:
        """Wait (at most ``timeout`` in all) until the NCCL aborts started so far have
        returned; returns whether they have."""
        with self._lock:
            aborts = list(self._aborts)
        deadline = Deadline.after(timeout)
        for aborted in aborts:
            if not aborted.wait(deadline.remaining_s()):
                if warn:
                    logger.warning(
                        "[rank %d] aborting an old NCCL generation takes over %.1f s; going on",
                        self.rank(),
                        timeout.total_seconds(),
                    )
                return False
        return True

    def _track(self, work: dist.Work | None, generation: int) -> None:
        if work is None:  # a collective that needed no communication (one member)
            return
        with self._lock:
            if generation != self._generation:
                return
            self._works.append(work)
            if len(self._works) <= _MAX_TRACKED_WORKS:
                return
            pending = self._works
        # Many collectives since the last check(): drop the oldest finished ones (FIFO on one
        # stream, so the front finishes first), recording a failure among them.
        while len(pending) > _MAX_TRACKED_WORKS // 2:
            done, failure = work_status(pending[0])
            if failure is not None:
                self._record(failure, generation)
                return
            if not done:
                return
            with self._lock:
                if pending is not self._works or not pending:
                    return
                pending.popleft()

    def _failed(self, generation: int) -> bool:
        """Whether ``generation`` has failed (or is no longer the current one)."""
        with self._lock:
            return self._error is not None or generation != self._generation

    def _record(self, exc: Exception, generation: int) -> None:
        with self._lock:
            if generation == self._generation and self._error is None:
                self._error = exc
                logger.warning("[rank %d] generation %d failed: %s", self.rank(), generation, exc)

    def shutdown(self) -> None:
        """Release the current generation (NCCL's communicators are aborted, so this
        never waits on a peer; it waits for that at most the group's timeout, as the
        process may exit right after), and the old generations still being dropped (a
        process must not exit while a thread destroys a gloo group)."""
        self._release(self._timeout)
        deadline = Deadline.after(self._timeout)
        for drop in self._drops:
            drop.join(deadline.remaining_s())

    for _name, _target in _FORWARD.items():
        locals()[_name] = _forward(_name, _target)
    del _name, _target


def _drop_gloo(holder: list) -> None:
    """Shut an old generation's gloo group down and drop the last reference to it here."""
    inner = holder.pop()
    try:
        inner.shutdown()
    except Exception as exc:  # noqa: BLE001 - a broken generation may not shut down cleanly
        logger.debug("shutting down an old generation: %s", exc)
    del inner


_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
_DUMP_WAIT = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"


def _nccl_environment() -> None:
    """Set what ProcessGroupNCCL reads when it is constructed, unless the user did.

    TORCH_NCCL_ASYNC_ERROR_HANDLING (or the older NCCL_ASYNC_ERROR_HANDLING),
    what the watchdog does with a failed or timed-out collective: 0 nothing, 1
    abort the communicators and tear the process down, 2 CleanUpOnly (abort the
    communicators, keep the process), 3 SkipCleanUp (tear down without aborting;
    torch's default). Under 1 or 3 a survivor whose peer died is killed, yet it
    must live to roll back and join the next generation: 2, and ``check()``
    sees the failure.

    TORCH_NCCL_DUMP_ON_TIMEOUT=0: on a failure the watchdog writes a flight
    recorder "dump" signal into the job's root store (not the generation's
    prefix), where it stays; the first NCCL group of every process (a promoted
    standby's included) polls for it, dumps, and kills its process after
    TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC unless that group is aborted first. A
    failover is expected here, not a hang to debug. And with no dump to wait
    for, TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=100: the watchdog sleeps 4x that
    (60 s by default) before it cleans up, holding the lock that every new
    collective takes, so a survivor still posting its step's collectives would
    stall that long.
    (As read in recent torch, 2.8 on: ProcessGroupNCCL.cpp, Watchdog/HeartbeatMonitor::runLoop.)
    """
    for name in _ERROR_HANDLING:
        value = os.environ.get(name)
        if value is not None:
            if value.strip() != "2":
                logger.warning(
                    "%s=%s: a survivor cannot recover in process (1 and 3 let NCCL's watchdog kill "
                    "it when a peer fails; 0 leaves a failed collective to the coordinator's abort); "
                    "2 is expected",
                    name,
                    value,
                )
            break
    else:
        os.environ[_ERROR_HANDLING[0]] = "2"
    if _DUMP_ON_TIMEOUT not in os.environ:
        os.environ[_DUMP_ON_TIMEOUT] = "0"
        os.environ.setdefault(_DUMP_WAIT, "100")


def _nccl(store: Store, rank: int, size: int, timeout: timedelta):
    """An NCCL group for one generation (its communicator is made at its first collective)."""
    _nccl_environment()  # before the constructor reads it
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _create(opts, _backend_options) -> ResilientProcessGroup:
    return ResilientProcessGroup(
        store=opts.store, rank=opts.group_rank, world_size=opts.group_size, timeout=opts.timeout, name=opts.group_id
    )


def init_resilient_process_group(
    *,
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(seconds=30),
    nccl_timeout: timedelta | None = None,
    generation: int | None = 0,
    ready_timeout: timedelta | None = None,
) -> ResilientProcessGroup:
    """Initialize torch.distributed's default group as a ResilientProcessGroup and
    connect ``generation`` (None: build it unconnected, as a standby does, which
    may build its FSDP2 model before it joins). ``timeout`` and ``nccl_timeout``
    as in ``ResilientProcessGroup``; ``ready_timeout`` as in ``configure``: members
    started far apart (processes of a loaded machine, actors Ray starts one by one)
    wait for each other that long before gloo's rendezvous, which ``timeout`` bounds.
    The group's keys go into ``store`` as given: pass a prefixed one (a role's
    ``JobStore.sub("pg")``) to keep them apart."""
    global _is_registered
    with _registered:
        if not _is_registered:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
            _is_registered = True
    dist.init_process_group(BACKEND_NAME, store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    if not isinstance(group, ResilientProcessGroup):
        raise ReplicaError(f"the default group is a {type(group).__name__}, not a ResilientProcessGroup")
    if nccl_timeout is not None:
        group.nccl_timeout = nccl_timeout
    if generation is not None:
        group.configure(generation, ready_timeout=ready_timeout)
    return group
