"""``warm_up``: run a training step ahead of time in a process that is not connected to
any generation yet (a standby waiting for its promotion), so that what a first step costs
(``torch.compile``'s tracing and code generation, CUDA's allocations and autotuning) is
paid before a failover instead of inside it.

The step's collectives complete at once without communicating (``ResilientProcessGroup.
rehearsal``): their outputs, the loss and the gradients are garbage. What the step changed
is put back: the gradients are dropped and every global RNG is set as before. What it must
not change is refused while it runs: an optimizer step (the parameters and the optimizer's
state are mirrored state) and a batch from a mirrored loader (its position is mirrored
state). A forward and a backward on a sample batch of the real shapes is the step to pass.

``compiled_graphs()`` counts the graphs ``torch.compile`` made in this process, so that
the first real step after a promotion can say whether the warm-up covered it."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from replica.distributed.resilient import ResilientProcessGroup
from replica.errors import ReplicaError
from replica.state.data import Batches
from replica.state.rng import RNGState

__all__ = ["WarmUp", "compiled_graphs", "warm_up"]


@dataclass(frozen=True, kw_only=True)
class WarmUp:
    """What a warm-up did: how long it took, and how many graphs ``torch.compile`` made in it."""

    seconds: float
    graphs: int


def compiled_graphs() -> int:
    """The graphs ``torch.compile`` (dynamo) has compiled in this process so far; 0 where
    dynamo was never imported (nothing was compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def _refusing_optimizer_steps(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    def refuse(*_args) -> None:
        raise ReplicaError(
            "warm_up(): the step called optimizer.step(); a warm-up runs a forward and a backward "
            "only (the parameters and the optimizer's state are mirrored state)"
        )

    handle = optimizer.register_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _holding(loaders: list[Batches]) -> Iterator[None]:
    reason = (
        "warm_up(): the step took a batch from a mirrored loader, whose position is mirrored state; "
        "pass the warm-up a sample batch of the real shapes instead"
    )
    for loader in loaders:
        loader.held = reason
    try:
        yield
    finally:
        for loader in loaders:
            loader.held = None


def warm_up(
    step: Callable[[], object],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, object],
    group: ResilientProcessGroup,
) -> WarmUp:
    """Run ``step()`` once in ``group``'s rehearsal (see the module docstring), then drop
    ``model``'s gradients and put every global RNG back. ``extra``'s loaders refuse batches
    meanwhile, ``optimizer`` refuses to step. Raises ``ReplicaError`` on a connected group."""
    rngs = RNGState()
    before = rngs.state_dict()
    graphs = compiled_graphs()
    started = time.perf_counter()
    try:
        with (
            group.rehearsal(),
            _refusing_optimizer_steps(optimizer),
            _holding([v for v in extra.values() if isinstance(v, Batches)]),
        ):
            step()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # its kernels are done before its garbage is dropped
    finally:
        for parameter in model.parameters():
            parameter.grad = None
        rngs.load_state_dict(before)
    return WarmUp(seconds=time.perf_counter() - started, graphs=compiled_graphs() - graphs)
