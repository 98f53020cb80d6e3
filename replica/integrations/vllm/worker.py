"""vLLM integration: weights pushed by ``replica.WeightSync`` land in a running
engine in place, without re-creating it and without touching disk.

Inside each worker the ``replica`` backend of vLLM's weight-transfer API
(``replica.integrations.vllm.transfer``) runs a ``WeightReceiver`` (``WorkerWeights``) that
receives and verifies versions in the background and applies a complete one
when ``update_weights`` asks: prepared beside the live model and switched in
(staged), or through the model runner's ``reload_weights`` (the CPU backend
repacks its linear weights after loading, so a plain ``model.load_weights``
after start-up fails there). ``EngineWeights`` drives it from the process that
owns the ``LLM`` through vLLM's own calls: ``update()`` between generations
applies the newest complete version and resets the prefix cache (cached KV
blocks were computed by the old weights); ``ReplicaWorkerExtension`` answers
the queries vLLM's API has no call for.

A reload that fails half-way leaves a vLLM engine broken, so every version's
names and shapes are checked against the checkpoint the engine was started from
before anything is loaded. Only the names, shapes and step travel through
vLLM's RPCs; the weights themselves arrive over ``replica.transport``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from replica.config import Config
from replica.errors import (
    EngineWorkersDisagreeError,
    LayoutMismatchError,
    VersionNotReadyError,
    WeightsTimeoutError,
    WeightTransferNotStartedError,
)
from replica.state.layout import StateLayout

if TYPE_CHECKING:
    from replica.jobstore import Registration

__all__ = [
    "EngineWeights",
    "ReceiverSpec",
    "ReplicaWorkerExtension",
    "WorkerWeights",
    "check_fits",
    "checkpoint_shapes",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True, slots=True)
class ReceiverSpec:
    """What a worker needs to start its receiver (plain values: it crosses ``collective_rpc``).
    The token travels to the worker, never to a log."""

    index: int
    store: str  # the job store's address (``replica.jobstore.stores.StoreAddress``: HOST:PORT or etcd://...)
    token_hex: str
    host: str = "127.0.0.1"
    store_prefix: str = "replica"
    timeout_s: float = 60.0
    # Prepare each version beside the live model and switch between generations (True), or load it
    # in place with vLLM's reload_weights (False). None: staged on CPU, where a reload repacks every
    # linear weight; in place on GPUs, where a reload is device copies and a second copy of the
    # weights would take memory vLLM budgeted for the KV cache.
    staged: bool | None = None
    leader: int = 0  # the trainer rank whose epoch the receiver accepts (WeightSync's leader)
    # Receive buffers (the model's size each). 1: staged, the received bytes go back to the OS as the
    # version is prepared and the engine holds the live weights and one more copy; a version arriving
    # while the last is prepared waits for it. 2: versions arrive while one is prepared or applied.
    buffers: int = 1
    # The transports the receiver may listen on, in order of preference (Config.backends); None:
    # Config's default. ("shm", ...) takes host weights from a trainer of this node with one copy.
    backends: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        return f"ReceiverSpec(index={self.index}, store={self.store})"

    def init_info(self) -> dict:
        """``init_weight_transfer_engine``'s ``init_info`` for an engine whose first worker is
        receiver ``index`` (``replica.integrations.vllm.transfer.ReplicaInitInfo``); the token goes in only
        when this spec carries one."""
        info = {
            "store": self.store,
            "index_base": self.index,
            "host": self.host,
            "store_prefix": self.store_prefix,
            "timeout_s": self.timeout_s,
            "staged": self.staged,
            "leader": self.leader,
            "buffers": self.buffers,
            "backends": None if self.backends is None else list(self.backends),
        }
        if self.token_hex:
            info["token_hex"] = self.token_hex
        return info


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint folder, from the file headers only."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle, no dict: keys() is all it has
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    return shapes


def check_fits(layout: StateLayout, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every pushed tensor must be a checkpoint tensor of the same shape (a subset is fine)."""
    for e in layout.entries:
        if e.name not in shapes:
            raise LayoutMismatchError(f"the engine's checkpoint has no tensor named {e.name!r}")
        if tuple(e.shape) != shapes[e.name]:
            raise LayoutMismatchError(
                f"{e.name}: {tuple(e.shape)} pushed, the engine's checkpoint has {shapes[e.name]}"
            )


class _Backends(TypedDict, total=False):
    """The ``Config`` field a ``ReceiverSpec`` sets when it names one (else Config's default)."""

    backends: tuple[str, ...]


class WorkerWeights:
    """A vLLM worker's receiver and how it applies versions: the one implementation behind
    ``ReplicaWorkerExtension`` and the ``replica`` weight-transfer backend
    (``replica.integrations.vllm.transfer``). ``reload(views)`` loads a version in place (vLLM's
    ``reload_weights``); staged, versions are prepared beside the live model instead."""

    def __init__(
        self,
        spec: ReceiverSpec,
        *,
        token: bytes,
        vllm_config,
        model,
        reload: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
    ):
        from replica.jobstore.stores import StoreAddress
        from replica.weights import WeightReceiver

        self.index = spec.index
        self._reload = reload
        shapes = checkpoint_shapes(vllm_config.model_config.model)
        store = StoreAddress.parse(spec.store).connect(timeout=timedelta(seconds=spec.timeout_s))
        backends: _Backends = {} if spec.backends is None else {"backends": tuple(spec.backends)}
        config = Config(
            token=token,
            host=spec.host,
            store_prefix=spec.store_prefix,
            timeout=timedelta(seconds=spec.timeout_s),
            **backends,
        )
        self._stager: _Stager | None = None
        self.receiver = WeightReceiver(
            index=spec.index,
            store=store,
            config=config,
            leader=spec.leader,
            buffers=spec.buffers,
            expect=lambda layout: check_fits(layout, shapes),
            on_ready=self._kick,
            on_receiving=self._superseding,
        )
        on_cpu = vllm_config.device_config.device_type == "cpu"
        staged = on_cpu if spec.staged is None else spec.staged
        if staged:
            self._stager = _Stager(self.receiver, model, spec.index, consume=spec.buffers == 1)
        logger.info(
            "[engine %d] weight receiver at %s (%s)",
            spec.index,
            self.receiver.address,
            "staged" if staged else "in place",
        )

    def _kick(self, step: int) -> None:
        stager = self._stager
        if stager is not None:
            stager.kick()

    def _superseding(self, step: int) -> None:
        stager = self._stager
        if stager is not None:
            stager.superseded(step)

    @property
    def staging(self) -> str:
        """How versions are applied: "staged", "in place", or why staging was given up."""
        if self._stager is None:
            return "in place"
        return "staged" if self._stager.active else f"in place: {self._stager.unsupported}"

    @property
    def dropped_versions(self) -> int:
        """Prepared versions dropped before the engine switched to them (staged with one
        receive buffer: a newer version started arriving)."""
        return 0 if self._stager is None else self._stager.dropped

    def pending(self) -> bool:
        """Whether ``apply()`` would serve a newer version at once (prepared when staged)."""
        served, stager = self.receiver.version, self._stager
        ready = stager.ready_step() if stager is not None and stager.active else self.receiver.ready()
        return ready is not None and (served is None or ready > served)

    def newest(self) -> int | None:
        """The newest version this worker has whole: received, or prepared when staged."""
        stager, received = self._stager, self.receiver.ready()
        prepared = stager.ready_step() if stager is not None and stager.active else None
        return max((v for v in (received, prepared) if v is not None), default=None)

    def wait(self, step: int, timeout: timedelta) -> bool:
        """Block until version >= ``step`` can be applied at once (received, and prepared when staged)."""
        stager = self._stager
        if stager is not None and stager.active:
            return stager.wait(step, timeout)
        return self.receiver.wait_ready(step, timeout)

    def apply(self, exactly: int | None = None) -> int | None:
        """Serve the newest complete version (or, with ``exactly``, that version: a
        VersionNotReadyError if it is not the newest complete one); returns its step (None:
        nothing new). Staged: switch to the prepared version (milliseconds). Otherwise, or
        when staging does not cover this model: vLLM's ``reload_weights`` in place."""
        receiver, stager = self.receiver, self._stager
        if exactly is not None and receiver.version == exactly:
            return None  # served already
        if stager is not None and stager.active:
            prepared = stager.take(receiver.version, exactly=exactly)
            if prepared is None:
                if exactly is not None:
                    raise VersionNotReadyError(
                        f"engine {self.index}: version {exactly} is not prepared "
                        f"(received: {receiver.ready()}, served: {receiver.version})"
                    )
                return None
            prepared.swap()
            receiver.served(prepared.step)
            stager.retire(prepared.retired)  # the old kernel handles are freed off the engine's thread
            return prepared.step
        with receiver.hold() as got:
            if got is None or (exactly is not None and got[0] != exactly):
                if exactly is not None:
                    raise VersionNotReadyError(
                        f"engine {self.index}: version {exactly} is not the newest complete "
                        f"one (received: {receiver.ready()}, served: {receiver.version})"
                    )
                return None
            step, views = got
            self._reload(views)
        receiver.served(step)
        return step

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self.receiver.close()


class ReplicaWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``) beside the ``replica``
    weight-transfer backend: queries of its receiver that vLLM's API has no call for (what
    arrived, what is served, by which trainer, how versions are applied), called through
    ``LLM.collective_rpc``. The receiver itself is the backend's (``replica.integrations.vllm.transfer``),
    started by ``init_weight_transfer_engine`` and applied by ``update_weights``."""

    @property
    def _replica(self) -> WorkerWeights:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "weights"):
            raise WeightTransferNotStartedError(
                "the engine has no replica weight-transfer backend: start it with "
                "EngineWeights.ENGINE_ARGS (weight_transfer_config={'backend': 'replica'})"
            )
        return engine.weights

    def replica_registration(self) -> Registration:
        return self._replica.receiver.registration

    def replica_ready(self) -> int | None:
        return self._replica.receiver.ready()

    def replica_pending(self) -> bool:
        """Whether ``update_weights`` with no version would apply a newer one at once."""
        return self._replica.pending()

    def replica_wait(self, step: int | str, timeout_s: float | str) -> bool:
        """Block until version >= ``step`` can be applied at once (received, and prepared when staged).
        (Strings: a server's ``/collective_rpc`` passes its arguments as strings.)"""
        return self._replica.wait(int(step), timedelta(seconds=float(timeout_s)))

    def replica_staging(self) -> str:
        return self._replica.staging

    def replica_version(self) -> int | None:
        return self._replica.receiver.version

    def replica_served_epoch(self) -> tuple[int, int] | None:
        """(generation, member) of the leader that sent the served version (None: none served)."""
        epoch = self._replica.receiver.served_epoch
        return None if epoch is None else (epoch.generation, epoch.member)


def _return_freed_memory() -> None:
    """Give the memory freed by a replaced version back to the OS now (glibc
    ``malloc_trim``): its tensors were many allocations below glibc's mmap threshold,
    whose pages the allocator would otherwise keep. A no-op on other allocators."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``); None elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


#: How much a consuming stager loads between two ``malloc_trim`` calls (each costs a walk of the
#: allocator's free lists: ~ms).
_TRIM_BYTES = 64 << 20


class _Stager:
    """Prepares each complete version beside the live model, in a thread of its
    own, so the engine keeps generating until it switches (``take``).

    ``consume`` (a receiver with one buffer): the engine holds the live weights and one
    more copy at most. The received bytes go back to the OS as preparation copies them
    out (``WeightReceiver.hold(consume=True)``), and a prepared version not yet switched
    to is dropped once a newer one starts arriving (``superseded``)."""

    def __init__(self, receiver, model, index: int, *, consume: bool = False):
        self._receiver = receiver
        self._model = model
        self._index = index
        self._consume = consume
        self.dropped = 0  # prepared versions dropped unused (a newer one arrived first)
        self._untrimmed = 0  # bytes loaded since memory was last given back
        self._cond = threading.Condition()
        self._prepared = None
        self._kicked = receiver.ready() is not None
        self._closed = False
        self._retired: list[list] = []
        self.unsupported: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"replica-stage-{index}", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self.unsupported is None

    def kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def retire(self, things: list) -> None:
        with self._cond:
            self._retired.append(things)
            self._cond.notify_all()

    def superseded(self, step: int) -> None:
        """Version ``step`` starts arriving: with ``consume``, a prepared version the engine has
        not switched to goes (freed on the stager's thread), unless it is newer (a step redone
        after a failover arrives again under the same number: it replaces the prepared one)."""
        if not self._consume:
            return
        with self._cond:
            prepared = self._prepared
            if prepared is None or prepared.step > step:
                return
            self._prepared = None
            self._retired.append([prepared])
            self.dropped += 1
            self._cond.notify_all()
        logger.info(
            "[engine %d] prepared version %d dropped unused: version %d is arriving", self._index, prepared.step, step
        )

    def ready_step(self) -> int | None:
        """The step of the version prepared and not yet taken (None: none)."""
        with self._cond:
            return None if self._prepared is None else self._prepared.step

    def take(self, served: int | None, exactly: int | None = None):
        """The prepared version if it is newer than ``served`` (and, with ``exactly``, is that
        version) and it is handed over, else None."""
        with self._cond:
            prepared = self._prepared
            if (
                prepared is None
                or (served is not None and prepared.step <= served)
                or (exactly is not None and prepared.step != exactly)
            ):
                return None
            self._prepared = None
            return prepared

    def wait(self, step: int, timeout: timedelta) -> bool:
        def done() -> bool:
            served = self._receiver.version
            prepared = self._prepared
            return (
                not self.active
                or (served is not None and served >= step)
                or (prepared is not None and prepared.step >= step)
            )

        with self._cond:
            self._cond.wait_for(done, timeout.total_seconds())
        if not self.active:  # given up while waiting: the version is applied in place
            return self._receiver.wait_ready(step, timeout)
        with self._cond:
            return done()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _processed(self, nbytes: int) -> None:
        """With ``consume``: every ``_TRIM_BYTES`` loaded, the memory that loading and
        processing freed (checkpoint-shaped tensors, the received bytes) goes back to the OS,
        so the engine's peak stays near the live weights and one copy."""
        if not self._consume:
            return
        self._untrimmed += nbytes
        if self._untrimmed >= _TRIM_BYTES:
            self._untrimmed = 0
            _return_freed_memory()

    def _run(self) -> None:
        from replica.integrations.vllm.staging import StagingUnsupported, check_vllm, prepare

        try:
            check_vllm()
        except StagingUnsupported as exc:
            self._give_up(str(exc))
            return
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._kicked or self._closed or self._retired)
                retired, self._retired = self._retired, []
                if self._closed:
                    return
                kicked, self._kicked = self._kicked, False
                floor = None if self._prepared is None else self._prepared.step
            if retired:
                del retired  # what the last switch replaced, freed here rather than on the engine's thread
                _return_freed_memory()
                if self._consume:  # the receive buffer's memory back now, while the engine generates
                    self._receiver.prefault()
            if not kicked:
                continue
            try:
                with self._receiver.hold(newer_than=floor, consume=self._consume) as got:
                    if got is None:
                        continue
                    step, views = got
                    start = time.perf_counter()
                    prepared = prepare(self._model, views, step, processed=self._processed)
                    if self._consume:
                        # Before the engine can switch: malloc_trim holds the allocator's lock, and
                        # a switch beside it waited for it (~35 ms for 1 GiB of weights).
                        _return_freed_memory()
                    # Prepared before the hold lets go: with ``consume`` the receiver then
                    # forgets the version, and it must never be neither received nor prepared.
                    with self._cond:
                        self._prepared = prepared
                        self._cond.notify_all()
                logger.info(
                    "[engine %d] weights of step %d prepared in %.3f s%s",
                    self._index,
                    step,
                    time.perf_counter() - start,
                    f"; {self._receiver.released_bytes / 2**20:.0f} MiB of the received bytes returned to the OS"
                    if self._consume
                    else "",
                )
            except StagingUnsupported as exc:
                self._give_up(str(exc))
                return
            except Exception as exc:
                logger.exception("[engine %d] preparing weights failed", self._index)
                self._give_up(f"{type(exc).__name__}: {exc}")
                return

    def _give_up(self, why: str) -> None:
        logger.warning("[engine %d] weights are applied in place from now on (staging: %s)", self._index, why)
        if self._consume and self._receiver.released_bytes:
            logger.error(
                "[engine %d] the version being prepared gave its memory back as it was read: it is "
                "lost here, and this engine serves the next version pushed",
                self._index,
            )
        with self._cond:
            self.unsupported = why
            self._prepared = None
            self._cond.notify_all()


class EngineWeights:
    """The driver's handle on an engine's weights, a thin user of vLLM's weight-transfer API
    with the ``replica`` backend: the engine is started with ``ENGINE_ARGS``; ``update()``
    between generations applies the newest complete version, ``wait(step)`` when a request
    needs a version. Applying goes through vLLM's own ``start_weight_update`` ->
    ``update_weights`` -> ``finish_weight_update``; the worker extension only answers queries."""

    EXTENSION = f"{__name__}.ReplicaWorkerExtension"
    #: What ``vllm.LLM(...)`` takes for an engine driven by EngineWeights.
    ENGINE_ARGS = {"worker_extension_cls": EXTENSION, "weight_transfer_config": {"backend": "replica"}}

    def __init__(self, llm, spec: ReceiverSpec):
        self.llm = llm
        self.spec = spec
        llm.init_weight_transfer_engine({"init_info": spec.init_info()})
        self.registrations = llm.collective_rpc("replica_registration")
        if len(self.registrations) != 1:
            self.close()
            raise NotImplementedError(
                f"an engine with {len(self.registrations)} workers (tensor parallel): each "
                "worker is a receiver of its own; drive it with vLLM's weight-transfer API "
                "(replica.integrations.vllm.transfer) and count its workers as engines"
            )

    @property
    def version(self) -> int | None:
        return self._one(self.llm.collective_rpc("replica_version"))

    @property
    def served_epoch(self) -> tuple[int, int] | None:
        """(generation, member) of the trainer incarnation that sent the served version:
        a zombie leader's would show here (the receivers refuse it)."""
        epoch = self._one(self.llm.collective_rpc("replica_served_epoch"))
        return None if epoch is None else (int(epoch[0]), int(epoch[1]))  # a list when it crossed processes

    @property
    def staging(self) -> str:
        """How versions are applied: "staged", "in place", or "in place: <why staging was given up>"."""
        return self._one(self.llm.collective_rpc("replica_staging"))

    def update(self) -> int | None:
        """Apply the newest complete version, if any; returns it (None: unchanged)."""
        if not any(self.llm.collective_rpc("replica_pending")):
            return None
        before = self.version
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"version": None}})
        self.llm.finish_weight_update()
        applied = self.version
        if applied == before:
            return None
        self.llm.reset_prefix_cache()  # KV blocks cached under the old weights are stale
        return applied

    def wait(self, step: int, timeout: timedelta) -> int:
        """Serve at least version ``step``: wait for it to arrive, then apply it."""
        if not all(self.llm.collective_rpc("replica_wait", args=(step, timeout.total_seconds()))):
            raise WeightsTimeoutError(
                f"engine {self.spec.index}: weights of step {step} did not arrive within {timeout}"
            )
        self.update()
        version = self.version
        assert version is not None  # a version >= step arrived, and is served now
        return version

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    @staticmethod
    def _one(results: list):
        """Every worker holds the same version (tensor-parallel workers apply together)."""
        if not results or any(r != results[0] for r in results):
            raise EngineWorkersDisagreeError(f"the engine's workers disagree: {results}")
        return results[0]
