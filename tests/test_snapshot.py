"""Snapshot: capture, keep training, restore, and the same steps give the same
losses bit for bit (the survivor's local rollback)."""

import random

import numpy as np
import pytest
import torch

from replica import RNGState
from replica.errors import LayoutMismatchError, ReplicaError
from replica.state import serialize
from replica.state.layout import StateLayout, state_tensors
from replica.state.snapshot import Snapshot, apply_extras, collect_extras


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
    layout = StateLayout.build(
        list(state_tensors(model, opt)), world_size=1, rank=0, extras_capacity=64 << 10, bucket_bytes=4096
    )
    snap = Snapshot(layout)
    snap.capture(tensors, serialize.encode(collect_extras(opt, extra)), step=3)

    first = [train_step(model, opt, sched) for _ in range(4)]
    extras = snap.restore(tensors)
    apply_extras(serialize.decode(extras), opt, extra)
    again = [train_step(model, opt, sched) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False)), (first, again)
    assert not torch.equal(first[0], first[1])  # the steps really differ


def test_capture_checks_shapes_and_room():
    model, opt, sched = setup()
    train_step(model, opt, sched)
    tensors = [t for _, t in state_tensors(model, opt)]
    layout = StateLayout.build(
        list(state_tensors(model, opt)), world_size=1, rank=0, extras_capacity=64, bucket_bytes=4096
    )
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
    # A shape that differs with the same bytes passes the pack; the check after it
    # still refuses, and the snapshot then holds no step.
    first = tensors[0]
    with pytest.raises(LayoutMismatchError, match="model.0.weight"):
        snap.capture([first.view(-1)] + tensors[1:], b"", step=2)
    assert snap.step is None and snap.digests is None


def test_extras_region_is_a_function_of_the_state_alone():
    """Only what the last capture's blob covered is zeroed again; a longer blob
    then a shorter one leaves the bytes a fresh buffer would hold, and a buffer
    written by something else (a receive) is zeroed whole at the next capture."""
    model, opt, sched = setup()
    train_step(model, opt, sched)
    tensors = [t for _, t in state_tensors(model, opt)]
    layout = StateLayout.build(
        list(state_tensors(model, opt)), world_size=1, rank=0, extras_capacity=4096, bucket_bytes=1024
    )
    at, end = layout.extras_offset, layout.extras_offset + layout.extras_capacity

    def captured(snap: Snapshot, extras: bytes) -> torch.Tensor:
        snap.capture(tensors, extras, step=1, digests=True)
        assert snap.digests == snap.compute_digests()
        return snap.buffer.clone()

    fresh = captured(Snapshot(layout), b"\x07" * 10)
    reused = Snapshot(layout)
    # The pack hashes up to the zeros after the blob and takes the zeros' digests as known
    # (Snapshot._head): blobs that end inside a bucket, on a bucket's boundary, and with the region.
    on_boundary = -(-(at + 8) // 1024) * 1024 - at - 8
    for blob in (b"\xff" * 3000, b"\x02" * on_boundary, b"\x03" * (end - at - 8), b"\x01" * 50, b"\x07" * 10):
        last = captured(reused, blob)
    assert torch.equal(last, fresh)
    reused.buffer[at:end].fill_(0xEE)  # as a receive of another rank's bytes would
    reused.written_elsewhere()
    assert torch.equal(captured(reused, b"\x07" * 10), fresh)
