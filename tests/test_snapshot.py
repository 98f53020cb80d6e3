"""Snapshot: capture, keep training, restore, and the same steps give the same
losses bit for bit (the survivor's local rollback)."""

import random

import numpy as np
import pytest
import torch

from replica import RNGState, serialize
from replica.errors import LayoutMismatchError, ReplicaError
from replica.layout import StateLayout, state_tensors
from replica.snapshot import Snapshot, apply_extras, collect_extras


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    model[3].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    return model, opt, sched


def train_step(model, opt, sched):
    x = torch.randn(16, 8) + float(np.random.rand()) + random.random()  # every RNG feeds the loss
    loss = model[3](model[2](model[1](model[0](x))).to(torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.detach()


def test_rollback_is_bit_identical():
    model, opt, sched = setup()
    extra = {"sched": sched, "rng": RNGState()}
    for _ in range(3):
        train_step(model, opt, sched)
    tensors = [t for _, t in state_tensors(model, opt)]
    layout = StateLayout.build(list(state_tensors(model, opt)), world_size=1, rank=0,
                               extras_capacity=64 << 10, bucket_bytes=4096)
    snap = Snapshot(layout)
    snap.capture(tensors, serialize.encode(collect_extras(opt, extra)), step=3)

    first = [train_step(model, opt, sched) for _ in range(4)]
    extras = snap.restore(tensors)
    apply_extras(serialize.decode(extras), opt, extra)
    again = [train_step(model, opt, sched) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again)), (first, again)
    assert not torch.equal(first[0], first[1])  # the steps really differ


def test_capture_checks_shapes_and_room():
    model, opt, sched = setup()
    train_step(model, opt, sched)
    tensors = [t for _, t in state_tensors(model, opt)]
    layout = StateLayout.build(list(state_tensors(model, opt)), world_size=1, rank=0, extras_capacity=64,
                               bucket_bytes=4096)
    snap = Snapshot(layout)
    with pytest.raises(ReplicaError, match="holds no state"):
        snap.restore(tensors)
    with pytest.raises(ReplicaError, match="the extras need 100 bytes, the layout reserves 56"):
        snap.capture(tensors, bytes(100), step=1)
    with pytest.raises(LayoutMismatchError, match="model.0.weight"):
        snap.capture([torch.zeros(3)] + tensors[1:], b"", step=1)
    with pytest.raises(LayoutMismatchError, match="state tensors"):
        snap.capture(tensors[:-1], b"", step=1)
    snap.capture(tensors, b"xyz", step=1)
    assert snap.extras() == b"xyz"
