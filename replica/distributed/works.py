"""How a ``ResilientProcessGroup``'s collective is waited on: ``GroupWork`` wraps the work of
the generation's inner backend (gloo, NCCL), waits for it in slices that an abort ends, and
records a failure on the group instead of raising it; CPU reduce-scatters go as allreduces
(gloo's own ignore a wait's timeout). Helpers to read a work's or a backend's state."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from replica.errors import ReplicaError

if TYPE_CHECKING:
    from replica.distributed.resilient import ResilientProcessGroup

__all__ = [
    "GLOO_WAIT_SLICE",
    "GroupWork",
    "REDUCE_SCATTERS",
    "allreduce_scattered",
    "backend_failure",
    "device_type",
    "work_status",
]

GLOO_WAIT_SLICE = timedelta(milliseconds=50)  # how often a gloo wait looks for an abort (a finish wakes it at once)
# gloo's reduce-scatters (torch 2.13: a LambdaWork) ignore wait()'s timeout and block until the
# group's own (10 s with a silent peer: a lost host), so an abort could not end a survivor's wait
# in FSDP2's gradient reduce-scatter. On CPU they are posted as gloo's allreduce of a copy, whose
# wait is sliced, the rank's chunk copied out once it finished (``allreduce_scattered``).
REDUCE_SCATTERS = frozenset({"_reduce_scatter_base", "reduce_scatter"})


class GroupWork(dist.Work):
    """Waits for the inner work; a failure is recorded on the group instead of raised."""

    def __init__(
        self,
        group: ResilientProcessGroup,
        inner: dist.Work | None,
        generation: int,
        *,
        gloo: bool = False,
        then: Callable[[], None] | None = None,
    ):
        """``then``: what completes the collective once the inner work finished well (the
        chunk of an allreduce that stands for a reduce-scatter)."""
        super().__init__()
        self._group = group
        self._inner = inner
        self._generation = generation
        self._gloo = gloo
        self._then = then

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._inner is not None:
            inner, self._inner = self._inner, None
            try:
                # gloo: blocks until done (or aborted). NCCL: makes the current stream wait for the
                # collective and raises only if a failure is already known; later ones are found by check().
                if self._gloo:
                    self._wait_gloo(inner)
                else:
                    inner.wait()
            except Exception as exc:  # noqa: BLE001 - a dead peer; the step will be redone
                self._group._record(exc, self._generation)
        self._finish()
        return True

    def _finish(self) -> None:
        """Run ``then`` once, unless the generation failed (its outputs are garbage then)."""
        then, self._then = self._then, None
        if then is not None and not self._group._failed(self._generation):
            then()

    def _wait_gloo(self, inner: dist.Work) -> None:
        """gloo waits for its own timeout on a peer that vanished without a reset (a lost or
        cut-off host); waiting in slices lets ``abort()`` (the coordinator announced the
        failover) end the wait at once. The abandoned collective ends with the old
        generation's group, whose shutdown does not wait for it."""
        while True:
            try:
                inner.wait(GLOO_WAIT_SLICE)
                return
            except RuntimeError:
                if inner.is_completed():
                    inner.wait()  # finished just after the slice: its own result, or its own error
                    return
                if self._group._failed(self._generation):
                    return  # the failure is recorded: the step is redone in the next generation

    def is_completed(self) -> bool:
        if self._inner is not None and not self._inner.is_completed():
            return False
        return self.wait()  # finished: its result collected (and ``then`` run) at once

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([])
        return future


def device_type(args: tuple) -> str:
    """The device of a collective's tensors (its first tensor argument, lists included)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, list | tuple) and arg:
            found = device_type(tuple(arg))
            if found:
                return found
    return ""


def allreduce_scattered(
    inner, target: str, rank: int, world: int, args: tuple, kwargs: dict
) -> tuple[dist.Work, Callable[[], None]]:
    """A CPU reduce-scatter (``_reduce_scatter_base(output, input, opts)``, or
    ``reduce_scatter(outputs, inputs, opts)``: ``inputs[i]`` one tensor per rank) posted as one
    allreduce of a flat copy of its inputs, with what copies this rank's chunks out after it."""
    outputs, inputs = args[0], args[1]
    opts = args[2] if len(args) > 2 else kwargs.get("opts")
    options = dist.AllreduceOptions()
    if opts is not None:
        options.reduceOp, options.timeout = opts.reduceOp, opts.timeout
    if target == "_reduce_scatter_base":
        outputs, inputs = [outputs], [list(inputs.reshape(world, -1))]
    flat = torch.cat([t.reshape(-1) for per_rank in inputs for t in per_rank])
    work = inner.allreduce([flat], options)

    def scatter() -> None:
        at = 0
        for output, per_rank in zip(outputs, inputs, strict=True):
            size = per_rank[0].numel()
            output.copy_(flat[at + rank * size : at + (rank + 1) * size].view_as(output))
            at += world * size

    return work, scatter


def work_status(work: dist.Work) -> tuple[bool, Exception | None]:
    """Whether an inner work has finished, and its failure. For NCCL,
    ``is_completed`` also polls the communicator's asynchronous error (a dead
    peer), so a failed collective counts as finished."""
    try:
        if not work.is_completed():
            return False, None
    except Exception as raised:  # noqa: BLE001 - asking a broken work may itself raise
        return True, raised
    try:
        exc = work.exception()
    except TypeError:
        # torch 2.11's binding cannot convert the exception_ptr it returns (seen on an
        # H100): no answer here; the backend's get_error() still reports a failure.
        return True, None
    except Exception as raised:  # noqa: BLE001 - asking a broken work may itself raise
        return True, raised
    if exc is None:
        return True, None
    return True, exc if isinstance(exc, Exception) else ReplicaError(f"collective failed: {exc}")


def backend_failure(inner) -> Exception | None:
    """The error an NCCL backend's watchdog recorded (a timeout or a communicator
    error), where this torch exposes it; None otherwise."""
    get_error = getattr(inner, "get_error", None)
    if get_error is None:
        return None
    try:
        error = get_error()
    except Exception:  # noqa: BLE001 - not supported by this backend or build
        return None
    name = getattr(error, "name", str(error))
    return None if name.endswith("SUCCESS") else ReplicaError(f"NCCL backend reports {name}")
