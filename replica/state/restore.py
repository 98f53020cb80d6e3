"""Write a snapshot's state into live objects in place: a model (FSDP2 or
plain), its optimizer and the ``extra`` Stateful objects. Shared by the
trainer's local rollback and the standby's restore."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replica.state import serialize
from replica.state.data import require_stateful
from replica.state.layout import StateLayout, state_tensors
from replica.state.snapshot import Snapshot, Stateful, apply_extras

__all__ = ["bind_state", "materialize_optimizer_state", "restore_snapshot"]


def materialize_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Give a fresh optimizer its per-parameter state (optimizers create it
    lazily in their first ``step``), so there is something to restore into.

    Runs one step on zero gradients with a learning rate of zero; the state
    this creates has the optimizer's own types (DTensors for FSDP2 parameters),
    and its values are overwritten by the restore that follows.
    """
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    if any(p.grad is not None for p in params):
        raise ValueError("restore into an optimizer whose parameters hold gradients; call zero_grad(set_to_none=True)")
    saved = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        saved.append(lr)
        if isinstance(lr, torch.Tensor):
            group["lr"] = torch.zeros_like(lr)
        elif lr is not None:
            group["lr"] = 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=False):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None


def bind_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, rank: int, world_size: int, like: StateLayout
) -> list[torch.Tensor]:
    """The state tensors of ``model``/``optimizer``, checked against ``like``
    (LayoutMismatchError names the first difference)."""
    named = list(state_tensors(model, optimizer))
    layout = StateLayout.build(
        named, world_size=world_size, rank=rank, extras_capacity=like.extras_capacity, bucket_bytes=like.bucket_bytes
    )
    layout.check_matches(like)
    return [t for _, t in named]


def restore_snapshot(
    snapshot: Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Stateful],
    *,
    rank: int,
    world_size: int,
) -> list[torch.Tensor]:
    """Restore ``snapshot`` into the objects in place; returns their state tensors.
    A data loader in ``extra`` is refused before anything is written: restore into the
    ``replica.Batches`` the loop takes its batches from."""
    extra = require_stateful(extra)
    materialize_optimizer_state(optimizer)
    tensors = bind_state(model, optimizer, rank=rank, world_size=world_size, like=snapshot.layout)
    extras = snapshot.restore(tensors)
    apply_extras(serialize.decode(extras), optimizer, extra)
    return tensors
