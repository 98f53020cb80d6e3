"""Weight sync: after a global commit, the trainers push the full parameters
into every rollout engine, in place, over ``replica.transport``.

Sender (``WeightSync``, every trainer rank): the parameters are gathered bucket
by bucket (FSDP2 ``full_tensor()``, a collective every rank joins; never the
whole model at once), and the leader rank packs each bucket with ``ops.pack``
into its retained copy of the packed weights (host memory) and sends it to
every engine while the next bucket is gathered. CUDA weights are packed on
their device and copied straight into the (then pinned) retained copy, one
event per bucket, so bucket k+1 is gathered, packed and copied while bucket k
is sent.
The retained copy lets the leader resend a bucket that failed its digest and
bring an engine that joins late up to date without waiting for the trainers.

Receiver (``WeightReceiver``, in the engine's process): receives a version into
a staging buffer, verifies every bucket, and only when all are good makes it
the *ready* version; ``apply(load)`` hands the engine an iterator over views of
the ready version's tensors (``reload_weights`` in vLLM) between generations.
A sync cut short (the sender dies, the link breaks) never reaches the engine:
it stays on its previous complete version, never a mix of two.

The bucket stream is the mirror's (``replica.bucketstream``): per connection the
sender sends its epoch and the weight layout; per sync ``BEGIN`` (step, buckets,
epoch), the buckets under ``BUCKET_BASE + i``, and the receiver answers
``REPLY``: ACKED, RESEND naming bad buckets, or FENCED. A receiver accepts only
the current epoch of the trainers' ``leader`` rank (any, without a coordinator):
a leader declared dead while still running (a zombie) cannot push weights. An
engine that could not be reached is tried again on later pushes, with backoff.
Keys in the store:
``{prefix}/engine/{i}`` (the receiver's registration) and
``{prefix}/engine/{i}/version`` (the version it serves).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from replica import ops
from replica.backends import SHM_BACKEND, transfer_buffer
from replica.bucketstream import Backoff, MirrorFaults, Outgoing, accept_sender, open_session, receive_versions
from replica.commit import NO_EPOCH, EpochRecord
from replica.config import Config
from replica.errors import FencedError, LayoutMismatchError, ReplicaError, TransportError
from replica.jobstate import Epoch, JobStore, Number, Registration, keys
from replica.layout import StateLayout, dtype_of
from replica.listener import Listener
from replica.pagebuffer import PageBuffer
from replica.protocol import Begin, answer_layout, fingerprint_int
from replica.registry import publish, registration
from replica.transport import Connection, MemoryKind, Transport
from replica.transport.base import memory_kind

__all__ = ["ModelSource", "ParamInfo", "ReceiverStats", "SyncStats", "WeightBucket", "WeightReceiver", "WeightSource",
           "WeightSync", "tensor_buckets", "weight_layout"]

logger = logging.getLogger(__name__)
_EPOCHS_KEPT = 8  # a receiver remembers the sender epoch of this many recent versions


class TensorMeta(Protocol):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class WeightSource(Protocol):
    """Full tensors a ``WeightSync`` pushes, for weights that are not one module's parameters
    (vLLM's ``WeightSource`` fits): ``metadata()`` names each tensor's name, shape and dtype
    with no transfer; iterating gives ``(name, full tensor)`` in that order, a fresh pass
    each push, on every trainer rank (gathers are collectives)."""

    def metadata(self) -> list[TensorMeta]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(kw_only=True, frozen=True, slots=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class ModelSource:
    """The ``WeightSource`` of a model's parameters (FSDP2 or plain): each one's full tensor,
    gathered one at a time (a collective every rank joins), cast to ``dtype`` if given."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype | None = None):
        self._params = list(model.named_parameters())
        self._dtype = dtype

    def metadata(self) -> list[ParamInfo]:
        return [ParamInfo(name=n, shape=tuple(p.shape), dtype=self._dtype or p.dtype) for n, p in self._params]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._params:
            full = _gather(p.detach()) if hasattr(p, "full_tensor") else p.detach()
            yield name, full if self._dtype is None or full.dtype == self._dtype else full.to(self._dtype)


@dataclass(kw_only=True, frozen=True, slots=True)
class WeightBucket:
    """Bytes [lo, hi) of the packed weights, holding whole tensors [first, end)."""

    lo: int
    hi: int
    first: int
    end: int


def weight_layout(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> StateLayout:
    """The packed layout of full (unsharded) weights; tensors may be on the meta device."""
    return StateLayout.build(named, world_size=1, rank=0, extras_capacity=0, bucket_bytes=bucket_bytes)


def tensor_buckets(layout: StateLayout) -> list[WeightBucket]:
    """Group whole tensors into buckets of about ``layout.bucket_bytes`` (a larger
    tensor is a bucket of its own): each bucket is gathered, packed and sent as one."""
    entries = layout.entries
    buckets, first = [], 0
    for i in range(1, len(entries) + 1):
        end_of = entries[i].offset if i < len(entries) else layout.total_bytes
        if i == len(entries) or end_of - entries[first].offset + entries[i].nbytes > layout.bucket_bytes:
            buckets.append(WeightBucket(lo=entries[first].offset, hi=end_of, first=first, end=i))
            first = i
    return buckets


def _views(buffer: torch.Tensor, layout: StateLayout) -> Iterator[tuple[str, torch.Tensor]]:
    for e in layout.entries:
        yield e.name, buffer[e.offset:e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)


def _consumable_views(page: PageBuffer, layout: StateLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``_views`` whose pages go back to the OS once a loader is done with them (PageBuffer)."""
    entries = list(layout.entries)
    spans = page.consumable((e.offset, e.offset + e.nbytes) for e in entries)
    for e, view in zip(entries, spans):
        yield e.name, view.view(dtype_of(e.dtype)).view(e.shape)


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What the last pushes did, for tests, benchmarks and logs."""

    pushes: int = 0
    bytes_sent: int = 0
    resent_buckets: int = 0
    engines_synced: list[int] = field(default_factory=list)  # of the last push
    engines_skipped: dict[int, str] = field(default_factory=dict)  # of the last push: engine -> why
    push_s: list[float] = field(default_factory=list)
    staged_buckets: int = 0  # packed on a GPU and copied down into the pinned retained copy


@dataclass(kw_only=True, slots=True)
class ReceiverStats:
    bytes_received: int = 0
    corrupted_buckets: int = 0
    fenced: int = 0  # senders refused for their epoch (a zombie leader), at connect or at a version
    prestaged: int = 0  # versions received into buffers posted before their BEGIN (none here)


class _Link:
    """The leader's connection to one engine's receiver."""

    def __init__(self, transport: Transport, conn: Connection, registration: Registration):
        self.transport, self.conn, self.registration = transport, conn, registration
        self.step: int | None = None  # the version it acknowledged last

    def close(self) -> None:
        self.conn.close()
        self.transport.close()


def _gather(p) -> torch.Tensor:
    """The full tensor of a DTensor parameter. FSDP2's dim-0 shards are gathered with
    one ``all_gather_into_tensor`` on the mesh's group (padded to equal chunks, as
    FSDP2 shards with ``torch.chunk``): that goes through the group's own methods,
    which a ``ResilientProcessGroup`` forwards, where ``full_tensor()``'s functional
    collectives need a C++ backend registered for the device. Other placements use
    ``full_tensor()``."""
    placements = p.placements
    if len(placements) != 1 or not placements[0].is_shard(0):
        return p.full_tensor()
    group = p.device_mesh.get_group()
    world, shape = group.size(), tuple(p.shape)
    rows = -(-shape[0] // world)
    local = p.to_local()
    padded = local.new_zeros((rows, *shape[1:]))
    padded[:local.shape[0]] = local
    out = local.new_empty((rows * world, *shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:shape[0]]


class _Staging:
    """Brings CUDA buckets down into the retained copy (pinned host memory). A
    bucket is packed on its device (one kernel on the current stream, after its
    gathers) into one of two device buffers, then copied straight into its place
    in the retained copy on a stream of its own; ``start`` returns the event that
    completes it. Two slots: a slot's device buffer is reused only once its copy
    has read it."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._device = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

    def start(self, full: list[torch.Tensor], offsets: list[int], target: torch.Tensor,
              word_offset: int | None) -> tuple[torch.cuda.Event, torch.Tensor | None]:
        """Pack ``full`` and start its copy into ``target``; returns the event that
        completes the copy and, with ``word_offset``, a pinned host tensor that holds
        the bucket's digest (``ops.pack_checksum``) once the event has completed."""
        slot, self._slot = self._slot, self._slot ^ 1
        # The caller's stream, in the caller's thread (push runs in the trainer's): the gathers
        # that produced ``full`` were queued on it just before, and nothing since.
        current = torch.cuda.current_stream(self.device)
        if self._copied[slot] is not None:  # the slot's previous copy has read its device buffer
            current.wait_event(self._copied[slot])
        staged = self._device[slot][:target.numel()]
        if sum(t.numel() * t.element_size() for t in full) != target.numel():
            staged.zero_()  # alignment gaps: the same bytes as a bucket packed on the host
        digest = None
        if word_offset is None:
            ops.pack(full, staged, offsets)
        else:
            on_device = ops.pack_checksum(full, staged, offsets, -(-staged.numel() // 8) * 8, word_offset)
            digest = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            target.copy_(staged, non_blocking=True)
            if digest is not None:
                digest.copy_(on_device, non_blocking=True)
                on_device.record_stream(self._stream)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copied[slot] = copied
        return copied, digest


class WeightSync:
    """Pushes ``model``'s full parameters to ``num_engines`` rollout engines.

    Every trainer rank creates one and calls ``push(step)`` at the same point
    (after a commit): the gathers are collectives. Only the ``leader`` rank
    talks to the engines. ``name_map`` renames parameters for the engine (HF
    checkpoint names for vLLM); ``dtype`` casts them on the way (for example
    bfloat16 for a bfloat16 engine, halving the bytes). ``epoch()`` is the
    sending trainer's epoch (``replica.jobstate.Epoch``), read at every
    connection and every push; receivers refuse a superseded one. Without it
    the leader sends ``NO_EPOCH``, which only a job without a coordinator accepts.
    """

    def __init__(self, model: torch.nn.Module | WeightSource, *, store: dist.Store | JobStore, num_engines: int,
                 config: Config, rank: int = 0, leader: int = 0, name_map: Callable[[str], str] | None = None,
                 dtype: torch.dtype | None = None, faults: MirrorFaults | None = None,
                 epoch: Callable[[], Epoch] | None = None):
        if num_engines < 0:
            raise ValueError(f"num_engines must be >= 0, got {num_engines}")
        self.config = config
        self.store = JobStore.of(store, token=config.token, prefix=config.store_prefix)
        self.num_engines = num_engines
        self.is_leader = rank == leader
        self.stats = SyncStats()
        self.faults = faults if faults is not None else MirrorFaults()
        rename = name_map or (lambda n: n)
        on_gpu = torch.cuda.is_available()
        if isinstance(model, torch.nn.Module):
            on_gpu = on_gpu and any(p.is_cuda for p in model.parameters())
            model = ModelSource(model)
        # A source's metadata, then its full tensors in that order, each push.
        shapes = [(rename(m.name), tuple(m.shape), m.dtype) for m in model.metadata()]
        self._source = lambda: ((rename(n), self._cast(t)) for n, t in model)
        if not shapes:
            raise ReplicaError("the model has no parameters to sync")
        self._dtype = dtype
        meta = [(n, torch.empty(shape, dtype=dtype or dt, device="meta")) for n, shape, dt in shapes]
        self.layout = weight_layout(meta, bucket_bytes=config.bucket_bytes_for("cuda" if on_gpu else "cpu"))
        self._buckets = tensor_buckets(self.layout)
        self._ranges = [(b.lo, b.hi) for b in self._buckets]
        self._epoch = epoch if epoch is not None else lambda: NO_EPOCH
        self._fingerprint = fingerprint_int(self.layout.fingerprint)
        # The leader keeps the last version packed (host memory, the model's full size): for
        # resends, and for engines that join between pushes.
        # Pinned for CUDA weights: their buckets are copied down into it directly, asynchronously.
        # In shared memory for host weights when the shm backend may carry them: offered where they lie.
        self._packed = transfer_buffer(self.layout.total_bytes, pin_memory=on_gpu,
                                       shared=SHM_BACKEND in config.backends) if self.is_leader else None
        self._staging: _Staging | None = None  # CUDA weights only
        # bucket.lo -> the event of its copy into _packed, and where its digest lands
        self._landing: dict[int, tuple[torch.cuda.Event, torch.Tensor | None]] = {}
        # Each bucket's digest, taken as it was packed (Config.verify): the sends hash nothing.
        self._digests: list[int] | None = [0] * len(self._buckets) if self.config.verify else None
        self._step: int | None = None  # the version in _packed
        self._links: dict[int, _Link] = {}
        self._retry: dict[Registration, Backoff] = {}  # registrations that could not be reached: when to try again
        self._fenced: dict[Registration, Epoch] = {}  # registrations that refused this leader: the epoch refused
        self._refused: set[Registration] = set()  # registrations that refused the layout
        self._lock = threading.Lock()  # push and refresh take turns on the links

    def push(self, step: int) -> SyncStats:
        """Gather, pack and send the weights of ``step`` to every live engine; an
        engine that fails (or refuses this leader's epoch) is skipped (it keeps its
        previous version), named in ``stats.engines_skipped`` and tried again on a
        later push. Returns the stats."""
        start = time.perf_counter()
        with self._lock:
            links, skipped = self._connect_all() if self.is_leader else ({}, {})
            outs: dict[int, Outgoing] = {}
            for i, link in links.items():
                out = self._outgoing(link, step)
                try:
                    out.begin()
                except TransportError as exc:
                    skipped[i] = self._drop(i, exc)
                    continue
                outs[i] = out

            def send(k: int) -> None:
                self._land(k)
                for i, out in list(outs.items()):
                    try:
                        out.send(k)
                    except TransportError as exc:
                        skipped[i] = self._drop(i, exc)
                        del outs[i]

            packed: deque[int] = deque()  # buckets packed, or on their way down from a GPU, not sent yet
            self._step = None  # _packed is being overwritten: a push cut short leaves no version to refresh
            tensors = self._source()
            try:
                for k, bucket in enumerate(self._buckets):
                    full = [self._next(tensors, j) for j in range(bucket.first, bucket.end)]
                    if not self.is_leader:
                        continue
                    offsets = [self.layout.entries[j].offset - bucket.lo for j in range(bucket.first, bucket.end)]
                    self._pack(k, full, offsets)
                    del full
                    packed.append(k)
                    # A host bucket goes at once; a CUDA one once the next is on its way down, so
                    # its copy overlaps the next one's gathers and pack.
                    while len(packed) > (1 if self._landing else 0):
                        send(packed.popleft())
                while packed:
                    send(packed.popleft())
            finally:
                for copied, _ in self._landing.values():  # a push cut short: no copy lands after it returns
                    copied.synchronize()
                self._landing.clear()
            self._step = step
            for i, out in outs.items():
                try:
                    self._settle(links[i], out)
                except (TransportError, FencedError) as exc:
                    skipped[i] = self._drop(i, exc)
        self.stats.pushes += 1
        self.stats.engines_synced = sorted(i for i in outs if i not in skipped)
        self.stats.engines_skipped = skipped
        self.stats.push_s.append(time.perf_counter() - start)
        if skipped:
            logger.warning("weights of step %d: engines %s skipped (%s)", step, sorted(skipped), skipped)
        return self.stats

    def refresh(self) -> list[int]:
        """Send the last pushed version to engines that do not hold it (one that
        joined or came back since); returns them. Leader only; no collective."""
        if not self.is_leader or self._step is None:
            return []
        done = []
        with self._lock:
            for i, link in self._connect_all()[0].items():
                if link.step == self._step:
                    continue
                out = self._outgoing(link, self._step)
                try:
                    out.send_all()
                    self._settle(link, out)
                    done.append(i)
                except (TransportError, FencedError) as exc:
                    self._drop(i, exc)
        return done

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()

    # --- the leader's side ---

    def _cast(self, full: torch.Tensor) -> torch.Tensor:
        return full if self._dtype is None or full.dtype == self._dtype else full.to(self._dtype)

    def _next(self, tensors: Iterator[tuple[str, torch.Tensor]], j: int) -> torch.Tensor:
        """Tensor ``j`` of the layout, the next the source gives (ReplicaError if it gives another)."""
        entry = self.layout.entries[j]
        name, full = next(tensors, (None, None))
        if name != entry.name or full is None or tuple(full.shape) != tuple(entry.shape):
            got = "nothing" if full is None else f"{name!r} {tuple(full.shape)}"
            raise ReplicaError(f"the weight source gave {got} where its metadata has {entry.name!r} "
                               f"{tuple(entry.shape)}: a source yields its tensors in its metadata's order")
        return full

    def _connect_all(self) -> tuple[dict[int, _Link], dict[int, str]]:
        """A link to every engine registered now (reconnecting to replaced ones), and
        why each other registered engine has none. A registration that could not be
        reached, or that refused this leader's epoch, is tried again with backoff (the
        latter at once when this leader's epoch changed since: it caught up with a new
        generation); one that refused the layout, never (a replacement registers anew)."""
        skipped: dict[int, str] = {}
        registered = set()
        for i in range(self.num_engines):
            current = registration(self.store, keys.engine(i))
            registered.add(current)
            link = self._links.get(i)
            if link is not None and link.registration == current:
                continue
            if link is not None:
                self._drop(i, TransportError("the engine registered anew"))
            if current is None:
                continue
            if current in self._refused:
                skipped[i] = f"engine {i} at {current.address} refused the weight layout"
                continue
            retry, epoch = self._retry.get(current), self._epoch()
            if retry is not None and not retry.due() and self._fenced.get(current, epoch) == epoch:
                skipped[i] = f"engine {i} at {current.address} refused or unreachable ({retry.failures} tries); " \
                             "tried again later"
                continue
            try:
                self._links[i] = self._connect(current, epoch)
                self._retry.pop(current, None)
                self._fenced.pop(current, None)
            except LayoutMismatchError as exc:
                self._refused.add(current)
                skipped[i] = str(exc)
                logger.warning("weight sync: engine %d at %s refused the layout: %s", i, current, exc)
            except (FencedError, TransportError) as exc:
                skipped[i] = str(exc)
                pause = self._retry.setdefault(current, Backoff()).failed()
                if isinstance(exc, FencedError):
                    self._fenced[current] = epoch
                logger.warning("weight sync: engine %d at %s %s (%s); next try in %s", i, current,
                               "refused this leader" if isinstance(exc, FencedError) else "unreachable", exc, pause)
        # Replaced registrations are forgotten.
        self._retry = {r: b for r, b in self._retry.items() if r in registered}
        self._fenced = {r: e for r, e in self._fenced.items() if r in registered}
        return dict(self._links), skipped

    def _connect(self, current: Registration, epoch: Epoch) -> _Link:
        transport, conn = open_session(current, memory=memory_kind(self._packed), config=self.config,
                                       epoch=epoch, layout=self.layout,
                                       peer=f"the engine at {current.address}",
                                       mismatch="the weight layout (its log names the first difference)")
        return _Link(transport, conn, current)

    def _pack(self, k: int, full: list[torch.Tensor], offsets: list[int]) -> None:
        """Pack bucket ``k`` into the retained host copy, taking its digest in the same
        pass. CUDA weights are packed on their device and start their way down
        (``_Staging``); ``_land`` completes them, waiting for that bucket's copy only."""
        bucket = self._buckets[k]
        word_offset = None if self._digests is None else bucket.lo // 8
        device = full[0].device
        if device.type == "cpu":
            target = self._packed[bucket.lo:bucket.hi]
            if word_offset is None:
                ops.pack(full, target, offsets)
            else:
                self._digests[k] = int(ops.pack_checksum(full, target, offsets, -(-target.numel() // 8) * 8,
                                                         word_offset).item())
            return
        if self._staging is None or self._staging.device != device:
            self._staging = _Staging(device, max(b.hi - b.lo for b in self._buckets))
        self._landing[bucket.lo] = self._staging.start(full, offsets, self._packed[bucket.lo:bucket.hi], word_offset)

    def _land(self, k: int) -> None:
        """Wait until a CUDA bucket is down in the retained copy, with its digest (a
        host bucket is there already)."""
        landing = self._landing.pop(self._buckets[k].lo, None)
        if landing is None:
            return
        copied, digest = landing
        copied.synchronize()
        if digest is not None:
            self._digests[k] = int(digest.item())
        self.stats.staged_buckets += 1

    def _outgoing(self, link: _Link, step: int) -> Outgoing:
        """Version ``step`` of the retained copy, going out to ``link``'s engine."""
        return Outgoing(link.conn, self._packed, self._ranges, step=step, epoch=self._epoch(),
                        fingerprint=self._fingerprint, config=self.config, faults=self.faults, counts=self.stats,
                        peer=f"the engine at {link.registration.address}", digests=self._digests)

    def _settle(self, link: _Link, out: Outgoing) -> None:
        out.settle()
        link.step = out.step

    def _drop(self, i: int, exc: Exception) -> str:
        link = self._links.pop(i, None)
        if link is not None:
            link.close()
        return str(exc)


class WeightReceiver(Listener):
    """The engine side: listens, receives versions, verifies them, and hands the
    engine complete versions only (``apply``). It accepts only a sender of the
    current epoch of trainer rank ``leader`` (the ``WeightSync`` leader) as the
    coordinator's generation record names it; without a record, any."""

    def __init__(self, *, index: int, store: dist.Store | JobStore, config: Config,
                 expect: Callable[[StateLayout], None] | None = None,
                 on_ready: Callable[[int], None] | None = None, leader: int = 0, buffers: int = 2,
                 on_receiving: Callable[[int], None] | None = None):
        if buffers not in (1, 2):
            raise ValueError(f"buffers is 1 or 2, got {buffers}")
        super().__init__(config=config, memory=MemoryKind.HOST, name=f"engine {index}")
        self.index = index
        self.leader = leader
        self.store = JobStore.of(store, token=config.token, prefix=config.store_prefix)
        self.epochs = EpochRecord(self.store)
        self.stats = ReceiverStats()
        self._expect = expect
        # 2: a version arrives while the last one is ready (applied when the engine likes); 1: one
        # buffer, the model's size (a version that starts arriving displaces an unapplied ready one).
        self._buffers = buffers
        self._on_ready = on_ready  # called (from the receiving thread) when a version is complete
        self._on_receiving = on_receiving  # called (from the receiving thread) when a version starts to arrive
        self._page: PageBuffer | None = None  # the one buffer (buffers=1): its pages can go back to the OS
        self._layout: StateLayout | None = None
        self._staging: torch.Tensor | None = None
        self._ready: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # a third buffer, used while the ready one is held
        self._ready_step: int | None = None
        self._held_buffer: torch.Tensor | None = None
        self._receiving = threading.Lock()  # one session at a time writes the staging buffer
        self.version: int | None = None  # the version the engine serves (applied)
        self.served_epoch: Epoch | None = None  # the epoch of the leader that sent it
        self._epochs: dict[int, Epoch] = {}  # the sender's epoch of each recent complete version
        self._sender: Connection | None = None  # the current sender's connection
        self.registration = publish(self.store, keys.engine(index), self.backend, self.address, self.fallback)
        self._start()

    def ready(self) -> int | None:
        """The newest complete version received, applied or not."""
        with self._cond:
            return self._ready_step

    def prefault(self) -> bool:
        """With one buffer whose memory went back to the OS: take it again now, off the
        receive's path (each page faulted in by the transfer costs it time). Contents kept;
        False where the kernel cannot (the receive then faults the pages in)."""
        page = self._page
        return page is not None and page.populate()

    @property
    def released_bytes(self) -> int:
        """Of the version last held with ``consume``, the bytes whose memory went back to the OS."""
        return 0 if self._page is None else self._page.dropped_bytes

    def wait_ready(self, step: int, timeout: timedelta) -> bool:
        """Block until a complete version >= ``step`` has been received."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ready_step is not None and self._ready_step >= step,
                                       timeout.total_seconds())

    @contextmanager
    def hold(self, newer_than: int | None = None, *,
             consume: bool = False) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]] | None]:
        """The newest complete version newer than ``newer_than`` (and than the
        served one) as ``(step, views)``, or None. Its buffer stays untouched
        while held: with two buffers, a version completing meanwhile goes to a
        spare buffer, so holding never delays the sender; with one, the next
        version waits. ``consume`` (one buffer only): each view's memory goes back
        to the OS once the caller is done with it (``PageBuffer``), so the version
        is no longer ready after the hold."""
        if consume and self._buffers != 1:
            raise ValueError("consume needs a receiver with one buffer")
        with self._cond:
            step = self._ready_step
            floor = max(v for v in (newer_than, self.version, -1) if v is not None)
            if step is None or step <= floor:
                got = None
            else:
                self._held_buffer = self._ready
                views = (_consumable_views(self._page, self._layout) if consume
                         else _views(self._ready, self._layout))
                got = (step, views)
        try:
            yield got
        finally:
            if got is not None:
                with self._cond:
                    self._held_buffer = None
                    if consume and self._ready_step == step:
                        self._ready, self._ready_step = None, None  # its bytes are gone
                    self._cond.notify_all()

    def served(self, step: int) -> None:
        """Record that the engine now serves version ``step`` (and report it in the store)."""
        with self._cond:
            self.version, self.served_epoch = step, self._epochs.get(step)
        self.store.put(keys.engine_version(self.index), Number(value=step))
        logger.info("[engine %d] serving weights of step %d (sent by %s)", self.index, step, self.served_epoch)

    def apply(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None]) -> int | None:
        """If a newer complete version is ready, call ``load`` with an iterator over
        ``(name, tensor)`` views of it (valid during the call), then record it as
        the served version. Returns the version applied, or None if none was new."""
        with self.hold() as got:
            if got is None:
                return None
            step, views = got
            load(views)
        self.served(step)
        return step

    def _held(self) -> str:
        return f"; serving version {self.version}"

    def _current_epoch(self) -> Epoch | None:
        return self.epochs.current_epoch(self.leader)

    def _session(self, conn: Connection) -> None:
        timeout = self.config.timeout
        _, layout = accept_sender(conn, current_epoch=self._current_epoch, who=self.name, timeout=timeout,
                                  counts=self.stats)

        def take(layout: StateLayout) -> None:
            if self._expect is not None:  # weights that do not fit are refused before they displace anyone
                self._expect(layout)
            # One sender at a time: a newer one (a promoted leader) replaces the old.
            with self._cond:
                previous, self._sender = self._sender, conn
            if previous is not None:
                previous.close()
            with self._receiving:  # the previous session has let go of the staging buffer
                self._adopt(layout)

        answer_layout(conn, layout, take, timeout)
        receive_versions(conn, [(b.lo, b.hi) for b in tensor_buckets(layout)],
                         fingerprint=fingerprint_int(layout.fingerprint), timeout=timeout, who=self.name,
                         counts=self.stats, current_epoch=self._current_epoch, closed=self._closed,
                         sender=lambda: self._sender, lock=self._receiving, stage=self._stage,
                         complete=self._complete)

    def _adopt(self, layout: StateLayout) -> None:
        with self._cond:
            if self._layout is not None:
                if self._layout.fingerprint == layout.fingerprint:
                    return
                self._layout.check_matches(layout)
            self._layout = layout
            self._page = PageBuffer(layout.total_bytes) if self._buffers == 1 else None
            self._staging = (self._page.tensor if self._page is not None
                             else torch.empty(layout.total_bytes, dtype=torch.uint8))
            self._ready = torch.empty(layout.total_bytes, dtype=torch.uint8) if self._buffers == 2 else None
            self._ready_step = None if self._buffers == 1 else self._ready_step
            self._spare = None
        logger.info("[engine %d] receiving %d tensors, %d bytes", self.index, len(layout.entries),
                    layout.total_bytes)

    def _stage(self, begin: Begin) -> torch.Tensor:
        """Where version ``begin.step`` is received. With one buffer: once nobody holds the
        ready version in it (an apply in progress finishes first), which is then no longer ready.
        ``on_receiving`` hears of it (a prepared version it supersedes can go)."""
        with self._cond:
            if self._buffers == 1:
                if not self._cond.wait_for(lambda: self._held_buffer is not self._staging or self._closed.is_set(),
                                           self.config.timeout.total_seconds()):
                    raise TransportError(f"{self.name}: the ready version was held for over {self.config.timeout}")
                if self._ready is self._staging:
                    self._ready, self._ready_step = None, None
            staging = self._staging
        if self._on_receiving is not None:
            self._on_receiving(begin.step)
        return staging

    def _complete(self, begin: Begin, buffer: torch.Tensor, digests: list[int]) -> None:
        """The staging buffer holds version ``begin.step`` complete and verified: it
        becomes the ready version; the next one goes where nobody reads (with two buffers)."""
        with self._cond:
            previous, self._ready, self._ready_step = self._ready, buffer, begin.step
            self._epochs[begin.step] = begin.epoch
            for old in sorted(self._epochs)[:-_EPOCHS_KEPT]:
                del self._epochs[old]
            if self._buffers == 1:
                pass  # the next version waits in _stage until this one is let go
            elif previous is not self._held_buffer:
                self._staging = previous
            else:
                if self._spare is None:
                    self._spare = torch.empty_like(previous)
                self._staging, self._spare = self._spare, previous
            self._cond.notify_all()
        if self._on_ready is not None:
            self._on_ready(begin.step)
