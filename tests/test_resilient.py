"""ResilientProcessGroup on its own (one member, gloo): collectives go to the
current generation's inner group; abort() fails the generation without
raising, later collectives of it return at once, and the next generation works."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from replica.resilient import ResilientProcessGroup, _device_type


def make_group() -> ResilientProcessGroup:
    return ResilientProcessGroup(store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5),
                                 name="test-resilient", cuda=False)


def allreduce(group: ResilientProcessGroup, value: float) -> torch.Tensor:
    t = torch.tensor([value])
    group.allreduce([t], dist.AllreduceOptions()).wait()
    return t


def test_generations_abort_and_recovery():
    group = make_group()
    seen = []
    group.on_collective = seen.append
    allreduce(group, 1.0)
    assert group.errored is not None  # no generation connected yet: recorded, not raised
    group.configure(0)
    assert group.errored is None and allreduce(group, 2.0).item() == 2.0
    group.abort("test failover")
    assert "aborted: test failover" in str(group.errored)
    assert allreduce(group, 3.0).item() == 3.0  # returned at once, no communication
    group.configure(1)
    assert group.generation == 1 and group.errored is None
    assert allreduce(group, 4.0).item() == 4.0
    assert seen == ["allreduce"] * 4
    with pytest.raises(ValueError, match="not newer"):
        group.configure(1)
    group.shutdown()


def test_device_of_a_collective():
    cpu = torch.zeros(1)
    assert _device_type(([cpu], object())) == "cpu"
    assert _device_type(([[cpu]],)) == "cpu"
    assert _device_type((1, "x")) == ""
