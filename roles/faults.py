"""Faults injected into a role for tests and demos (``replica launch --inject``): a kill
or a freeze at a phase of a step, a slow link, a lost rollout engine, a durable part corrupted."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from replica.jobstore import JobStore, Stamp, keys
from replica.roles.env import Action, Fault, Phase, Role, RoleState, process_group
from replica.timing import pause

__all__ = ["FaultPlan"]

logger = logging.getLogger(__name__)


class FaultPlan:
    """The injected faults of one role process, held by its ``replica.roles.runtime.Job``,
    which calls its hooks where a step passes their phase. It owns the faults of its rank
    (from ``RoleEnv.faults``) and decides when each fires: at its phase of its step, in the
    role the process has then (a promoted standby's are a trainer's: ``role.role``), in its
    process-group generation if it names one (``role.group``), and once (stamped in the job
    store first: a step redone after a failover does not fire it again). It fires them
    itself: SIGKILL, SIGSTOP, a stall, a byte of a durable part flipped. A plan with no
    fault of this process is the null plan: every hook returns at once and ``install``
    installs nothing."""

    def __init__(self, faults: Sequence[Fault], *, role: RoleState, rank: int, store: JobStore):
        self._faults = tuple(f for f in faults if f.rank == rank)
        self._role = role  # read at each hook: the role and the group change
        self._rank = rank
        self._store = store

    def install(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], int]) -> None:
        """Hook the faults of the backward, the optimizer step and FSDP2's reduce-scatter
        into ``model``, ``optimizer`` and the role's process group; ``step()`` is the step
        in progress."""
        if not self._faults:
            return

        def on_backward(module, grad_output):
            self.fire(Phase.BACKWARD, step())

        # The last module holding parameters sees its output's gradient early in backward.
        last = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))][-1]
        last.register_full_backward_pre_hook(on_backward)
        optimizer.register_step_pre_hook(lambda *a: self.fire(Phase.OPTIMIZER, step()))

        def on_collective(name: str) -> None:
            if name == "reduce_scatter_single":  # FSDP2's gradient reduce-scatter
                self.fire(Phase.REDUCE_SCATTER, step())

        process_group(self._role).on_collective = on_collective

    def on_shard(self, step: int) -> None:
        """A rollout's fault fires at the first shard it generates for its step or a later one
        (which engine takes which shard depends on which is up first)."""
        for f in self._faults:
            if f.role == Role.ROLLOUT and f.step <= step:
                self.fire(f.phase, f.step)

    def while_waiting(self) -> Callable[[JobStore], None] | None:
        """What a standby waiting for its promotion calls at each look at the store (over
        ``store``, its own connection): its faults fire once its trainer has logged their step.
        None when this standby has none (it then looks less often)."""
        faults = [f for f in self._faults if f.role == Role.STANDBY]
        if not faults:
            return None

        def look(store: JobStore) -> None:
            for f in faults:
                if store.has(keys.loss(self._rank, f.step)):
                    self.fire(f.phase, f.step)

        return look

    def _claim(self, f: Fault, step: int) -> bool:
        """Whether ``f`` fires now (it is this role's and this generation's, and did not fire
        before: each fault fires once, not again when the step is redone); stamps it fired."""
        group = self._role.group
        if f.generation is not None and (group is None or group.generation != f.generation):
            return False
        key = keys.killed(str(f))
        if self._store.has(key):
            return False
        self._store.put(key, Stamp(at=time.time()))
        # A round trip on the same connection: the stamp is in the store before this process stops (a
        # TCPStore set is not acknowledged, and a SIGKILL with unread replies resets the connection).
        self._store.has(key)
        logger.warning("[%s rank %d step %d] injected fault %s fires", self._role.role, self._rank, step, f)
        return True

    def on_written(self, step: int, path: Path) -> None:
        """A standby's ``corrupt`` fault: one byte of its durable part of ``step`` (``path``,
        written and synced) flipped in the middle of the file, in the tensors' bytes."""
        for f in self._faults:
            if f.action == Action.CORRUPT and (f.role, f.step) == (self._role.role, step) and self._claim(f, step):
                with open(path, "r+b") as file:
                    file.seek(path.stat().st_size // 2)
                    byte = file.read(1)
                    file.seek(-1, os.SEEK_CUR)
                    file.write(bytes([byte[0] ^ 0x01]))

    def fire(self, phase: Phase, step: int) -> None:
        """Fire this role's faults of ``phase`` of ``step`` that did not fire yet."""
        for f in self._faults:
            if f.role != self._role.role or f.step != step or f.phase != phase:
                continue
            if f.action == Action.CORRUPT or not self._claim(f, step):  # (corrupt: on_written's)
                continue
            if f.action == Action.STALL:
                assert f.duration is not None  # Fault gives every stall its duration (3 s unless told)
                pause(f.duration)
            elif f.action == Action.FREEZE:
                for handler in logging.getLogger().handlers:  # what it logged is out before it stops
                    handler.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
                logger.warning("[%s rank %d step %d] woke up from the freeze", self._role.role, self._rank, step)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
