"""Data loaders as mirrored state (``replica.Batches``): a run restored from a mid-epoch
state takes exactly the batches, and leaves exactly the RNG streams, of the run that was
never interrupted: plain ``DataLoader`` (shuffled from the global RNG, its own generator,
a ``DistributedSampler``, two workers with random augmentation) and torchdata's
``StatefulDataLoader``, across epoch boundaries, whatever order the extras come back in."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import replica
from replica.errors import ReplicaError
from replica.state import serialize
from replica.state.data import Batches, prepare_extras


class Augmented(Dataset):
    """Each item drawn with random noise: from the global RNGs in the main process, from the
    worker's seeded RNGs in a worker."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


def _loader(kind: str) -> DataLoader:
    data = Augmented()
    if kind == "shuffled":  # RandomSampler: its seed from the global torch RNG, each epoch
        return DataLoader(data, batch_size=3, shuffle=True)
    if kind == "generator":
        return DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7))
    if kind == "distributed":
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3))
    if kind == "workers":
        return DataLoader(data, batch_size=3, shuffle=True, num_workers=2)
    if kind == "stateful":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        return stateful.StatefulDataLoader(data, batch_size=3, shuffle=True)
    if kind == "stateful-workers":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        return stateful.StatefulDataLoader(data, batch_size=3, shuffle=True, num_workers=2)
    raise AssertionError(kind)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _step(batches: Batches) -> tuple[torch.Tensor, torch.Tensor]:
    batch = next(batches)
    dropout = torch.rand(4)  # the model's own draws from the global RNG, after the batch
    return batch, dropout


LOADERS = ["shuffled", "generator", "distributed", "workers", "stateful", "stateful-workers"]


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("rng_first", [False, True], ids=["loader-first", "rng-first"])
def test_a_restored_run_takes_the_batches_of_the_uninterrupted_one(kind, rng_first):
    total, cut = 17, 9  # 7 or 10 batches an epoch: the run crosses epochs before and after the cut
    _seed(0)
    batches = Batches(_loader(kind), name="train")
    reference, mirrored = [], None
    for step in range(1, total + 1):
        reference.append(_step(batches))
        if step == cut:  # the commit: the state goes through the mirror's encoding
            mirrored = serialize.encode({"train": batches.state_dict(), "rng": replica.RNGState().state_dict()})
    assert batches.epoch >= 1, "the run must cross an epoch boundary"

    _seed(12345)  # another process: other RNG states, a fresh loader
    restored = Batches(_loader(kind), name="train")
    for _ in range(3):  # it even ran ahead before the rollback
        next(restored)
    state = serialize.decode(mirrored)
    order = [("rng", replica.RNGState()), ("train", restored)]
    for name, obj in order if rng_first else order[::-1]:
        obj.load_state_dict(state[name])
    assert restored.restores == 1
    for step in range(cut + 1, total + 1):
        batch, dropout = _step(restored)
        want_batch, want_dropout = reference[step - 1]
        assert torch.equal(batch, want_batch), f"step {step}: another batch than the uninterrupted run's"
        assert torch.equal(dropout, want_dropout), f"step {step}: the model's RNG stream moved"


@pytest.mark.parametrize("kind", ["shuffled", "stateful"])
def test_restored_before_the_first_batch_starts_the_epoch_as_the_run_did(kind):
    _seed(0)
    batches = Batches(_loader(kind), name="train")
    state = serialize.encode({"train": batches.state_dict(), "rng": replica.RNGState().state_dict()})
    reference = [_step(batches) for _ in range(4)]
    _seed(99)
    restored = Batches(_loader(kind), name="train")
    decoded = serialize.decode(state)
    restored.load_state_dict(decoded["train"])
    replica.RNGState().load_state_dict(decoded["rng"])
    for want_batch, want_dropout in reference:
        batch, dropout = _step(restored)
        assert torch.equal(batch, want_batch) and torch.equal(dropout, want_dropout)


def test_a_state_dict_between_restore_and_next_batch_is_the_restored_one():
    _seed(0)
    batches = Batches(_loader("shuffled"), name="train")
    for _ in range(5):
        next(batches)
    state = batches.state_dict()
    other = Batches(_loader("shuffled"), name="train")
    other.load_state_dict(state)
    assert serialize.encode(other.state_dict()) == serialize.encode(state)


def test_what_cannot_be_positioned_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"extra\['train'\] \(a generator\).*DataLoader"):
        prepare_extras({"train": (i for i in range(3))})
    with pytest.raises(TypeError, match=r"extra\['batches'\] \(a list\)"):
        prepare_extras({"batches": [1, 2, 3]})
    with pytest.raises(ReplicaError, match="persistent_workers"):
        Batches(DataLoader(Augmented(), num_workers=1, persistent_workers=True))
    with pytest.raises(TypeError, match="DataLoader"):
        Batches([1, 2, 3])
    wrapped = prepare_extras({"train": _loader("shuffled"), "rng": replica.RNGState()})
    assert isinstance(wrapped["train"], Batches) and isinstance(wrapped["rng"], replica.RNGState)
    assert prepare_extras({"train": wrapped["train"]})["train"] is wrapped["train"]
    stateful = Batches(_loader("stateful"))
    with pytest.raises(ReplicaError, match="StatefulDataLoader"):
        Batches(_loader("shuffled")).load_state_dict(stateful.state_dict())
