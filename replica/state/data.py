"""Data loaders as mirrored state: ``Batches`` owns a loader's iterator.

A training loop that holds ``iter(loader)`` itself cannot be rolled back: after a
failover the loader's state is restored, but the loop's iterator runs on from where it
was (torchdata's ``StatefulDataLoader``), or a new iterator starts the epoch over; and a
``torch.utils.data.DataLoader`` draws its workers' base seed (and a ``RandomSampler``
its shuffle seed) from the global torch RNG each time an iterator is made, so a restored
process that makes one iterator more than the failure-free run did shifts every later
random draw of the model (dropout). ``Batches`` is the loop's iterator instead: pass the
loader in ``extra`` (``Replicator``/``job.replicate`` wrap it) and take batches from it,
epoch after epoch. After a restore its next batch is the one the failure-free run took.

How it stays exact without disturbing any RNG the model uses:

* At the start of each epoch it records the state of the generators the loader's new
  iterator draws from (the global torch RNG, the loader's and its sampler's own
  ``generator``), calls ``set_epoch`` on a sampler that has one (``DistributedSampler``),
  and makes the iterator.
* Its state is (epoch, batches taken in the epoch, those generator states). A restore
  only records it; the next batch makes the iterator anew: the generators set to the
  epoch's start, the iterator made, the batches already taken drawn again and dropped,
  then every global RNG (torch, numpy, Python) put back as the restore left it. So the
  iterator is the one the failure-free run made for that epoch, and the RNG streams are
  the mirrored ones, whatever order the extras were restored in.
* A ``StatefulDataLoader`` without workers positions itself (its own ``state_dict``);
  its new iterator is made under the same guard (it draws a seed it then overrides).
  With workers it is replayed like a plain ``DataLoader``: torchdata restores its
  workers' position but seeds their RNGs afresh (``base_seed + worker_id``), so a random
  augmentation in a worker would differ from the failure-free run's.

Replaying the taken batches costs up to an epoch of loading after a restore of a plain
``DataLoader`` (or a ``StatefulDataLoader`` with workers); a ``StatefulDataLoader``
without workers skips them. ``persistent_workers=True`` is
refused: its workers keep random state across epochs that no restore can rebuild.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import DataLoader

from replica.errors import ReplicaError

__all__ = ["Batches", "is_loader", "prepare_extras", "require_stateful"]

logger = logging.getLogger(__name__)

_PLAIN = "DataLoader"
_END = object()
_STATEFUL = "StatefulDataLoader"


class _StatefulLoader(Protocol):
    """What torchdata's ``StatefulDataLoader`` adds to a ``DataLoader``: its position as state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _stateful_loader_type() -> type | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is an extra (replica[data])
        return None
    return StatefulDataLoader


def is_loader(obj: object) -> bool:
    """Whether ``obj`` is a data loader ``Batches`` wraps (a ``DataLoader``, or a subclass
    such as torchdata's ``StatefulDataLoader``)."""
    return isinstance(obj, DataLoader)


def _kind(loader: DataLoader) -> str:
    stateful = _stateful_loader_type()
    return _STATEFUL if stateful is not None and isinstance(loader, stateful) else _PLAIN


def _sampler(loader: DataLoader):
    """The loader's index sampler (the one ``set_epoch`` and a ``generator`` would be on)."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None and getattr(loader, "batch_sampler", None) is not None:
        sampler = getattr(loader.batch_sampler, "sampler", None)
    return sampler


@contextlib.contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Every global RNG (torch CPU and CUDA, numpy, Python) as it was before the block."""
    torch_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


class Batches:
    """The training loop's iterator over ``loader`` (a ``torch.utils.data.DataLoader`` or
    torchdata's ``StatefulDataLoader``), epoch after epoch without end, and its position
    as ``Stateful`` state (see the module docstring). ``next(batches)`` gives the next
    batch; ``epoch`` and ``taken`` say where it is; ``restores`` counts the restores it
    followed. It calls ``set_epoch`` on the loader's sampler itself at each epoch: do not."""

    def __init__(self, loader: DataLoader, *, name: str = "loader"):
        if not is_loader(loader):
            raise TypeError(
                f"{name}: Batches wraps a torch.utils.data.DataLoader (or torchdata's StatefulDataLoader), "
                f"got {type(loader).__name__}"
            )
        if loader.persistent_workers and loader.num_workers > 0:
            raise ReplicaError(
                f"{name}: a DataLoader with persistent_workers=True keeps its workers' random state "
                "from one epoch to the next, which no restore can rebuild; set persistent_workers=False"
            )
        from torch.utils.data.datapipes.datapipe import IterDataPipe

        if isinstance(loader.dataset, IterDataPipe):
            raise ReplicaError(
                f"{name}: a DataLoader over a DataPipe draws a seed shared across ranks for each "
                "iterator; replica cannot position one. Use a map-style or iterable Dataset"
            )
        self.loader = loader
        self.name = name
        self.kind = _kind(loader)
        # Positioned by its own state (torchdata, no workers), or replayed from the epoch's start.
        self.positions = self.kind == _STATEFUL and loader.num_workers == 0
        self.epoch = 0
        self.taken = 0  # batches taken from the current epoch
        self.restores = 0
        self.held: str | None = None  # why batches are refused now (a warm-up runs), else None
        self._it: Iterator | None = None
        self._started: dict[str, Any] | None = None  # the generator states the epoch's iterator was made from
        self._restored: dict[str, Any] | None = None  # a state restored, applied at the next batch
        self._sampler = _sampler(loader)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self.held is not None:
            raise ReplicaError(f"{self.name}: {self.held}")
        it = self._it if self._it is not None else self._start()
        try:
            batch = next(it)
        except StopIteration:
            self.epoch, self.taken, self._it = self.epoch + 1, 0, None
            try:
                batch = next(self._start())
            except StopIteration:
                raise ReplicaError(f"{self.name}: the loader gives no batch in epoch {self.epoch}") from None
        self.taken += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        if self._restored is not None:  # restored and not iterated since: that state still
            return dict(self._restored)
        state: dict[str, Any] = {"kind": self.kind, "epoch": self.epoch, "taken": self.taken}
        if self.positions:
            if self._it is not None:
                state["loader"] = self._stateful().state_dict()
            else:
                # Before the first batch it makes an iterator for the state (the next batch
                # then takes that one): under the guard, so that draw moves no RNG. Its state
                # holds what the loader made from the RNG when it was built (its sampler's
                # generator), which a restore into another process's loader needs.
                with _global_rngs_kept():
                    state["loader"] = self._stateful().state_dict()
        else:
            state["started"] = self._started  # None before the first batch
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind or ("loader" in state) != self.positions:
            raise ReplicaError(
                f"{self.name}: the mirrored state is of a {state.get('kind')} "
                f"{'positioned by its own state' if 'loader' in state else 'replayed'}, this loader is "
                f"a {self.kind} {'positioned by its own state' if self.positions else 'replayed'} "
                "(the same loader, with as many workers, on every role)"
            )
        self._restored = dict(state)
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])
        self._it = None  # the next batch makes the iterator anew, positioned
        self.restores += 1

    # --- the iterator ---

    def _stateful(self) -> _StatefulLoader:
        # (only where self.positions: _kind found a StatefulDataLoader, which the annotation cannot say)
        return cast(_StatefulLoader, self.loader)

    def _set_epoch(self) -> None:
        if self._sampler is not None and hasattr(self._sampler, "set_epoch"):
            self._sampler.set_epoch(self.epoch)

    def _generators(self) -> dict[str, torch.Generator]:
        found = {}
        if self.loader.generator is not None:
            found["loader"] = self.loader.generator
        sampler_generator = getattr(self._sampler, "generator", None)
        if isinstance(sampler_generator, torch.Generator) and sampler_generator is not self.loader.generator:
            found["sampler"] = sampler_generator
        return found

    def _start(self) -> Iterator:
        """Make the epoch's iterator (``_it``), positioned as restored; returns it."""
        restored, self._restored = self._restored, None
        if restored is not None and not restored.get("loader" if self.positions else "started"):
            # Restored before its first batch: the failure-free run made this iterator at
            # this point, from the RNG states the restore set, and so does this one.
            restored = None
        if restored is None:  # a new epoch (or the first): made as a plain loop would make it
            self._started = {
                "torch": torch.get_rng_state(),
                **{k: g.get_state() for k, g in self._generators().items()},
            }
            self._set_epoch()
            self._it = iter(self.loader)
            return self._it
        with _global_rngs_kept():  # the model's RNG streams stay as the restore left them
            if self.positions:
                self._stateful().load_state_dict(restored["loader"])
                self._set_epoch()
                self._it = iter(self.loader)
                return self._it
            started = self._started = restored["started"]
            torch.set_rng_state(started["torch"])
            for key, generator in self._generators().items():
                if key in started:
                    generator.set_state(started[key])
            self._set_epoch()
            self._it = iter(self.loader)
            for taken in range(self.taken):
                if next(self._it, _END) is _END:
                    raise ReplicaError(
                        f"{self.name}: epoch {self.epoch} gives {taken} batches now, {self.taken} were "
                        "taken from it before the restore: the loader's data or order changed"
                    )
        if self.taken:
            logger.info("[%s] positioned after %d batches of epoch %d (drawn again)", self.name, self.taken, self.epoch)
        return self._it

    def __repr__(self) -> str:
        return f"Batches({self.name!r}, {self.kind}, epoch={self.epoch}, taken={self.taken})"


def prepare_extras(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` for a ``Replicator``: data loaders wrapped in ``Batches`` (kept as they
    are when already wrapped); anything else must be ``Stateful`` (``state_dict`` and
    ``load_state_dict``), or a ``TypeError`` names it and the fix."""
    return {
        name: Batches(obj, name=name) if is_loader(obj) else obj
        for name, obj in require_stateful(extra, loaders=True).items()
    }


def require_stateful(extra: Mapping[str, Any] | None, *, loaders: bool = False) -> dict[str, Any]:
    """``extra`` as a dict, every object ``Stateful``; a data loader is refused unless
    ``loaders`` (a restore writes its position into the ``Batches`` that wraps it, which
    the loop must then take its batches from: pass that, not the loader)."""
    checked = {}
    for name, obj in dict(extra or {}).items():
        if is_loader(obj) and not loaders:
            raise TypeError(
                f"extra[{name!r}] is a {type(obj).__name__}: restore into replica.Batches(loader) and "
                "take the batches from that object (it holds the restored position, the loader does not)"
            )
        if not is_loader(obj) and not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            kind = type(obj).__name__
            raise TypeError(
                f"extra[{name!r}] (a {kind}) has no state_dict()/load_state_dict(): its position cannot "
                "be mirrored, so a restored job would not take the batches the failure-free run took. "
                "Pass a torch.utils.data.DataLoader or torchdata StatefulDataLoader (replica owns its "
                "iterator: take batches from Replicator.batches(name) / job.next_batch(name)), or give "
                "the object state_dict() and load_state_dict()"
            )
        checked[name] = obj
    return checked
