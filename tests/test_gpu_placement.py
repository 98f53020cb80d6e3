"""Snapshots of state that spans the GPU and the host (replica.state.placement): a CUDA model's
default AdamW keeps its step counters on the host; a standby may hold its mirror in pinned
host memory and restore into a GPU model. Each way against ops.reference_pack on the host."""

from __future__ import annotations

import pytest
import torch

from replica import ops
from replica.errors import ReplicaError
from replica.state.layout import StateLayout, state_tensors
from replica.state.placement import pack_state, state_device, unpack_state
from replica.state.restore import materialize_optimizer_state
from replica.state.snapshot import Snapshot

pytestmark = pytest.mark.gpu


def _mixed():
    g = torch.Generator().manual_seed(3)
    host = [torch.tensor(7.0), torch.randn(5, generator=g).double(), torch.empty(0), torch.tensor(True)]
    device = [
        torch.randn(1000, 3, generator=g).cuda(),
        torch.randint(0, 9, (17,), generator=g).cuda().to(torch.int16),
        torch.randn(33, generator=g).cuda().bfloat16(),
    ]
    return [device[0], host[0], device[1], host[1], host[2], device[2], host[3]]


def _reference(tensors):
    offsets, total = ops.aligned_offsets(tensors)
    out = torch.zeros(-(-total // 64) * 64 + 64, dtype=torch.uint8)
    ops.reference_pack([t.cpu() for t in tensors], out, offsets)
    return out, offsets


@pytest.mark.parametrize("where", ["cuda", "pinned", "pageable"])
def test_pack_and_unpack_across_devices(where):
    tensors = _mixed()
    expected, offsets = _reference(tensors)
    if where == "cuda":
        buffer = torch.zeros_like(expected, device="cuda")
    else:
        buffer = torch.zeros_like(expected, pin_memory=where == "pinned")
    pack_state(tensors, buffer, offsets)
    torch.cuda.synchronize()
    assert torch.equal(buffer.cpu(), expected)
    targets = [torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for t in tensors]
    unpack_state(buffer, targets, offsets)
    torch.cuda.synchronize()
    for t, r in zip(tensors, targets, strict=False):
        assert r.device == t.device and torch.equal(r.cpu(), t.cpu())


def test_state_device_is_the_accelerator():
    assert state_device([torch.zeros(1), torch.zeros(1, device="cuda")]) == torch.device("cuda", 0)
    assert state_device([torch.zeros(1)]) == torch.device("cpu")
    with pytest.raises(ReplicaError, match="only host <-> one accelerator"):
        fake = torch.zeros(1, device="meta")
        pack_state([fake], torch.zeros(64, dtype=torch.uint8, device="cuda"), [0])


def _model_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # default: foreach, not fused, not capturable
    return model, optimizer


def _step(model, optimizer, seed: int) -> float:
    x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("mirror", ["cuda", "cpu"])
def test_cuda_adamw_snapshot_restores_bit_for_bit(mirror):
    """The state of a CUDA model with default AdamW spans cuda and cpu (step counters);
    a snapshot on the GPU, or copied to a pinned host mirror as a standby holds it,
    restores into a fresh GPU model and the next steps equal the original's."""
    model, optimizer = _model_and_adamw(0)
    _step(model, optimizer, 1)
    named = list(state_tensors(model, optimizer))
    assert {t.device.type for _, t in named} == {"cuda", "cpu"}  # the case this is about
    layout = StateLayout.build(named, world_size=1, rank=0, extras_capacity=4096, bucket_bytes=1 << 20)
    snapshot = Snapshot(layout, device=state_device([t for _, t in named]))
    assert snapshot.buffer.is_cuda
    snapshot.capture([t for _, t in named], b"extras", step=1)
    held = snapshot
    if mirror == "cpu":
        held = Snapshot(layout, device="cpu", pin_memory=True)
        assert held.buffer.is_pinned()
        held.buffer.copy_(snapshot.buffer)
        held.step = 1
    expected = [_step(model, optimizer, s) for s in (2, 3)]

    fresh, fresh_opt = _model_and_adamw(99)
    materialize_optimizer_state(fresh_opt)
    targets = [t for _, t in state_tensors(fresh, fresh_opt)]
    assert held.restore(targets) == b"extras"
    assert [_step(fresh, fresh_opt, s) for s in (2, 3)] == expected
