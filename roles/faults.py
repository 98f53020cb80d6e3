"""Faults injected into a role for tests and demos (``replica launch --inject``): a kill
or a freeze at a phase of a step, a slow link, a lost rollout engine, a durable part corrupted."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch

from replica.jobstore import Stamp, keys
from replica.roles.env import Action, Fault, Phase, Role
from replica.timing import pause


__all__ = ["Faults"]

logger = logging.getLogger(__name__)


class Faults:
    """``Job``'s part: the injected faults. Mixed into ``replica.roles.runtime.Job``, whose state
    it uses."""

    def _install_faults(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        mine = [f for f in self.env.faults if f.rank == self.rank]
        if not mine:
            return

        def on_backward(module, grad_output):
            self._fault(Phase.BACKWARD, self._step)

        # The last module holding parameters sees its output's gradient early in backward.
        last = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))][-1]
        last.register_full_backward_pre_hook(on_backward)
        optimizer.register_step_pre_hook(lambda *a: self._fault(Phase.OPTIMIZER, self._step))

        def on_collective(name: str) -> None:
            if name == "reduce_scatter_single":  # FSDP2's gradient reduce-scatter
                self._fault(Phase.REDUCE_SCATTER, self._step)

        self.group.on_collective = on_collective

    def _rollout_fault(self, step: int) -> None:
        """A rollout's fault fires at the first shard it generates for its step or a later one
        (which engine takes which shard depends on which is up first)."""
        for f in self.env.faults:
            if f.role == Role.ROLLOUT and f.rank == self.rank and f.step <= step:
                self._fault(f.phase, f.step)

    def _claim(self, f: Fault, step: int) -> bool:
        """Whether ``f`` fires now (it is this role's and this generation's, and did not fire
        before: each fault fires once, not again when the step is redone); stamps it fired."""
        if f.generation is not None and (self.group is None or self.group.generation != f.generation):
            return False
        key = keys.killed(str(f))
        if self.store.has(key):
            return False
        self.store.put(key, Stamp(at=time.time()))
        # A round trip on the same connection: the stamp is in the store before this process stops (a
        # TCPStore set is not acknowledged, and a SIGKILL with unread replies resets the connection).
        self.store.has(key)
        logger.warning("[%s rank %d step %d] injected fault %s fires", self.role, self.rank, step, f)
        return True

    def _floor_fault(self, step: int, path: Path) -> None:
        """A standby's ``corrupt`` fault: one byte of its durable part of ``step`` (``path``,
        written and synced) flipped in the middle of the file, in the tensors' bytes."""
        for f in self.env.faults:
            if f.action == Action.CORRUPT and (f.role, f.rank, f.step) == (self.role, self.rank, step) and \
                    self._claim(f, step):
                with open(path, "r+b") as file:
                    file.seek(path.stat().st_size // 2)
                    byte = file.read(1)
                    file.seek(-1, os.SEEK_CUR)
                    file.write(bytes([byte[0] ^ 0x01]))

    def _fault(self, phase: Phase, step: int) -> None:
        for f in self.env.faults:
            if f.rank != self.rank or f.role != self.role or f.step != step or f.phase != phase:
                continue
            if f.action == Action.CORRUPT or not self._claim(f, step):  # (corrupt: _floor_fault's)
                continue
            if f.action == Action.STALL:
                pause(f.duration)
            elif f.action == Action.FREEZE:
                for handler in logging.getLogger().handlers:  # what it logged is out before it stops
                    handler.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
                logger.warning("[%s rank %d step %d] woke up from the freeze", self.role, self.rank, step)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
