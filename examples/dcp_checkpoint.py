"""What users do today, and the baseline replica is measured against
(bench/ettr.py, bench/test_failover.py): a ``torch.distributed.checkpoint`` of
the model and optimizer every K steps into a folder every rank can reach (a
shared file system), each rank's extras (RNG, data position) beside it, and a
start from the newest complete checkpoint after a restart."""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from replica.roles.env import Role

__all__ = ["Checkpoints", "add_arguments"]

_DONE = ".done"  # written by rank 0 once every rank's part is in: holds the save's seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="save a torch.distributed.checkpoint here every --checkpoint-every steps (a folder every "
        "host reaches) and start from the newest one (`replica coordinator --standbys 0 "
        "--resume-step STEP`: the checkpoint-restart baseline)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")


class Checkpoints:
    """``root/STEP/``: one DCP checkpoint per saved step, complete once ``.done`` is in it."""

    @classmethod
    def of(cls, parser: argparse.ArgumentParser, args: argparse.Namespace) -> Checkpoints | None:
        """From ``add_arguments``' options (None without them)."""
        if (args.checkpoint_dir is None) != (args.checkpoint_every == 0):
            parser.error("--checkpoint-dir and --checkpoint-every go together")
        return cls(args.checkpoint_dir, args.checkpoint_every) if args.checkpoint_dir else None

    def __init__(self, root: Path, every: int):
        if every < 1:
            raise ValueError(f"need a checkpoint interval >= 1 step, got {every}")
        self.root, self.every = Path(root), every
        self.root.mkdir(parents=True, exist_ok=True)

    def newest(self) -> int | None:
        """The newest complete checkpoint's step (None: there is none)."""
        done = [int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p / _DONE).exists()]
        return max(done, default=None)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, object],
        *,
        rank: int,
    ) -> float:
        """Save ``step`` (collective: every rank calls it); returns the seconds it took."""
        start = time.perf_counter()
        folder = self.root / str(step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
        # The user's own file on the user's own disk (numpy's RNG state needs the full unpickler).
        torch.save({name: obj.state_dict() for name, obj in extra.items()}, folder / f"extras.{rank}.pt")
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            (folder / _DONE).write_text(f"{seconds!r}\n")
        return seconds

    def load(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, object],
        *,
        rank: int,
    ) -> None:
        folder = self.root / str(step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = torch.load(folder / f"extras.{rank}.pt", weights_only=False)
        for name, obj in extra.items():
            obj.load_state_dict(saved[name])

    def restore(
        self, job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, object]
    ) -> None:
        """A trainer of a ``replica.roles`` job: load the newest checkpoint, if any, and tell
        the job it starts after it (``job.restored``). Call before ``job.replicate``."""
        if job.role == Role.TRAINER and (last := self.newest()) is not None:
            self.load(last, model, optimizer, extra, rank=job.rank)
            job.restored(last)

    def after(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, object],
        *,
        rank: int,
    ) -> None:
        """Save ``step`` when one is due (after its commit)."""
        if self.due(step):
            self.save(step, model, optimizer, extra, rank=rank)

    def seconds(self, step: int) -> float:
        """How long saving ``step`` took (rank 0's measure)."""
        return float((self.root / str(step) / _DONE).read_text())
