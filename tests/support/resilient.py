"""A ResilientProcessGroup of one member for the tests, and a collective on it."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from replica.distributed.resilient import ResilientProcessGroup

__all__ = ["allreduce", "make_group"]


def make_group(**kw) -> ResilientProcessGroup:
    """A one-member group over a HashStore (gloo, no CUDA unless told), 5 s timeouts."""
    return ResilientProcessGroup(
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=5),
        name="test-resilient",
        **{"cuda": False, **kw},
    )


def allreduce(group: ResilientProcessGroup, value: float) -> torch.Tensor:
    """``value`` all-reduced over ``group``, waited for."""
    t = torch.tensor([value])
    group.allreduce([t], dist.AllreduceOptions()).wait()
    return t
