"""The divergence guard's record: a step redone after a failover that did not reproduce
what it computed before the failure (its loss, or the state its optimizer step left).

Every survivor of a failure knows what it computed for the steps it redoes; a promoted
standby knows the state its trainer streamed before dying. A difference means the run
left the failure-free trajectory: something that feeds the loss is not mirrored state
(an RNG consumer outside ``extra``, a data iterator the loop holds itself), or the
computation is not deterministic (a GPU without deterministic settings, where the guard
says "not comparable" instead of crying wolf)."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

import torch

__all__ = ["Divergence", "Measure", "comparable", "likely_causes"]


class Measure(enum.Enum):
    LOSS = "loss"  # the step's loss, as an exact float
    STATE = "state"  # the digests of the snapshot its commit packed (parameters, optimizer state, extras)
    INPUT = "input"  # the digests of each forward's inputs and of the RNG states at its start (replica.state.inputs)


@dataclass(kw_only=True, frozen=True, slots=True)
class Divergence:
    rank: int
    step: int
    measure: Measure
    before: str  # what the step computed before the failover
    after: str  # what its redo computed
    comparable: bool  # False: the computation is not deterministic here (see ``comparable``)
    where: str = ""  # for the state: the buckets that differ and the tensors in the first

    def to_dict(self) -> dict:
        return {**asdict(self), "measure": self.measure.value}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Divergence:
        data = json.loads(text)
        return cls(**{**data, "measure": Measure(data["measure"])})

    def describe(self) -> str:
        if self.measure is Measure.LOSS:
            line = (
                f"rank {self.rank} step {self.step} DIVERGED after the failover: its loss is {self.after}, "
                f"it was {self.before} before"
            )
        elif self.measure is Measure.INPUT:
            line = (
                f"rank {self.rank} step {self.step} DIVERGED after the failover: {self.where} differ from those "
                f"of its first attempt before the failure (digest {self.after}, was {self.before})"
            )
        else:
            line = (
                f"rank {self.rank} step {self.step} DIVERGED after the failover: its state after the optimizer "
                f"step differs from the one packed before the failure in {self.where}"
            )
        if not self.comparable:
            return line + " (not comparable: this computation is not deterministic; see replica.state.divergence)"
        return f"{line}. {likely_causes()}"


def likely_causes() -> str:
    return (
        "Likely causes: a random draw outside the mirrored state (an RNG of its own that is not in extra; "
        "pass replica.RNGState()), a data iterator the loop holds itself (take batches from "
        "job.next_batch(name) / Replicator.batches(name)), or other state the loop keeps outside extra "
        "(register a job.on_restore callback)"
    )


def comparable(model: torch.nn.Module) -> bool:
    """Whether a redo of ``model``'s step must reproduce it bit for bit here: on the CPU
    (with gloo), or on a GPU with ``torch.use_deterministic_algorithms(True)`` (the
    settings ``examples/fsdp_job.deterministic_cuda`` makes). Otherwise kernels may
    reduce in another order each run, and a difference says nothing."""
    on_gpu = any(p.device.type != "cpu" for p in model.parameters())
    return not on_gpu or torch.are_deterministic_algorithms_enabled()
