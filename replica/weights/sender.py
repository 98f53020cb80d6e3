"""Weight sync's sender (``WeightSync``, every trainer rank): the parameters gathered
bucket by bucket and pushed from the leader into every engine (the package's docstring
has the protocol)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.distributed_c10d import Store

from replica import ops
from replica.config import Config
from replica.errors import FencedError, LayoutMismatchError, ReplicaError, TransportError
from replica.jobstore import Epoch, JobStore, Registration, keys
from replica.jobstore.commit import NO_EPOCH
from replica.jobstore.registry import registration
from replica.session.backends import SHM_BACKEND
from replica.session.bucketstream import MirrorFaults, Outgoing, open_session, registration_backoff
from replica.session.protocol import fingerprint_int
from replica.timing import Backoff
from replica.transport import Connection, Transport
from replica.transport.base import memory_kind
from replica.transport.buffers import transfer_buffer
from replica.weights.layout import ModelSource, WeightSource, tensor_buckets, weight_layout

__all__ = ["SyncStats", "WeightSync"]

logger = logging.getLogger(__name__)


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


class _Link:
    """The leader's connection to one engine's receiver."""

    def __init__(self, transport: Transport, conn: Connection, registration: Registration):
        self.transport, self.conn, self.registration = transport, conn, registration
        self.step: int | None = None  # the version it acknowledged last

    def close(self) -> None:
        self.conn.close()
        self.transport.close()


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

    def start(
        self, full: list[torch.Tensor], offsets: list[int], target: torch.Tensor, word_offset: int | None
    ) -> tuple[torch.cuda.Event, torch.Tensor | None]:
        """Pack ``full`` and start its copy into ``target``; returns the event that
        completes the copy and, with ``word_offset``, a pinned host tensor that holds
        the bucket's digest (``ops.pack_checksum``) once the event has completed."""
        slot, self._slot = self._slot, self._slot ^ 1
        # The caller's stream, in the caller's thread (push runs in the trainer's): the gathers
        # that produced ``full`` were queued on it just before, and nothing since.
        current = torch.cuda.current_stream(self.device)
        copied = self._copied[slot]
        if copied is not None:  # the slot's previous copy has read its device buffer
            current.wait_event(copied)
        staged = self._device[slot][: target.numel()]
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
    sending trainer's epoch (``replica.jobstore.Epoch``), read at every
    connection and every push; receivers refuse a superseded one. Without it
    the leader sends ``NO_EPOCH``, which only a job without a coordinator accepts.
    """

    def __init__(
        self,
        model: torch.nn.Module | WeightSource,
        *,
        store: Store | JobStore,
        num_engines: int,
        config: Config,
        rank: int = 0,
        leader: int = 0,
        name_map: Callable[[str], str] | None = None,
        dtype: torch.dtype | None = None,
        faults: MirrorFaults | None = None,
        epoch: Callable[[], Epoch] | None = None,
    ):
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
        self._packed = (
            transfer_buffer(self.layout.total_bytes, pin_memory=on_gpu, shared=SHM_BACKEND in config.backends)
            if self.is_leader
            else None
        )
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
            raise ReplicaError(
                f"the weight source gave {got} where its metadata has {entry.name!r} "
                f"{tuple(entry.shape)}: a source yields its tensors in its metadata's order"
            )
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
                skipped[i] = (
                    f"engine {i} at {current.address} refused or unreachable ({retry.failures} tries); "
                    "tried again later"
                )
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
                pause = self._retry.setdefault(current, registration_backoff()).failed()
                if isinstance(exc, FencedError):
                    self._fenced[current] = epoch
                logger.warning(
                    "weight sync: engine %d at %s %s (%s); next try in %s",
                    i,
                    current,
                    "refused this leader" if isinstance(exc, FencedError) else "unreachable",
                    exc,
                    pause,
                )
        # Replaced registrations are forgotten.
        self._retry = {r: b for r, b in self._retry.items() if r in registered}
        self._fenced = {r: e for r, e in self._fenced.items() if r in registered}
        return dict(self._links), skipped

    def _leader_copy(self) -> torch.Tensor:
        """The retained packed copy, which the leader alone keeps (and packs, and sends)."""
        if self._packed is None:
            raise ReplicaError("only the leader rank keeps a packed copy of the weights")
        return self._packed

    def _connect(self, current: Registration, epoch: Epoch) -> _Link:
        transport, conn = open_session(
            current,
            memory=memory_kind(self._leader_copy()),
            config=self.config,
            epoch=epoch,
            layout=self.layout,
            peer=f"the engine at {current.address}",
            mismatch="the weight layout (its log names the first difference)",
        )
        return _Link(transport, conn, current)

    def _pack(self, k: int, full: list[torch.Tensor], offsets: list[int]) -> None:
        """Pack bucket ``k`` into the retained host copy, taking its digest in the same
        pass. CUDA weights are packed on their device and start their way down
        (``_Staging``); ``_land`` completes them, waiting for that bucket's copy only."""
        bucket, packed, digests = self._buckets[k], self._leader_copy(), self._digests
        word_offset = None if digests is None else bucket.lo // 8
        device = full[0].device
        if device.type == "cpu":
            target = packed[bucket.lo : bucket.hi]
            if digests is None:
                ops.pack(full, target, offsets)
            else:
                digests[k] = int(
                    ops.pack_checksum(full, target, offsets, -(-target.numel() // 8) * 8, bucket.lo // 8).item()
                )
            return
        if self._staging is None or self._staging.device != device:
            self._staging = _Staging(device, max(b.hi - b.lo for b in self._buckets))
        self._landing[bucket.lo] = self._staging.start(full, offsets, packed[bucket.lo : bucket.hi], word_offset)

    def _land(self, k: int) -> None:
        """Wait until a CUDA bucket is down in the retained copy, with its digest (a
        host bucket is there already)."""
        landing = self._landing.pop(self._buckets[k].lo, None)
        if landing is None:
            return
        copied, digest = landing
        copied.synchronize()
        if digest is not None:
            assert self._digests is not None  # a digest is taken only where they are kept (_pack)
            self._digests[k] = int(digest.item())
        self.stats.staged_buckets += 1

    def _outgoing(self, link: _Link, step: int) -> Outgoing:
        """Version ``step`` of the retained copy, going out to ``link``'s engine."""
        return Outgoing(
            link.conn,
            self._leader_copy(),
            self._ranges,
            step=step,
            epoch=self._epoch(),
            fingerprint=self._fingerprint,
            config=self.config,
            faults=self.faults,
            counts=self.stats,
            peer=f"the engine at {link.registration.address}",
            digests=self._digests,
        )

    def _settle(self, link: _Link, out: Outgoing) -> None:
        out.settle()
        link.step = out.step

    def _drop(self, i: int, exc: Exception) -> str:
        link = self._links.pop(i, None)
        if link is not None:
            link.close()
        return str(exc)
