"""A bad job script for tests: its standbys build a wider model than its
trainers, so the mirrored state's layout cannot match (a script whose model
differs between roles)."""

import sys
from pathlib import Path

import torch

import replica.roles
from replica.roles.env import Role

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp_job import JobShape, build_job, train_step


def main() -> None:
    torch.set_num_threads(1)
    job = replica.roles.init()
    total = job.env.steps
    shape = JobShape(total_steps=total, dim=96 if job.role == Role.STANDBY else 64)
    state = build_job(shape, rank=job.rank, world_size=job.env.world_size)
    job.replicate(state.model, state.optimizer, state.extra)
    for step in job.steps(total):
        job.log(step, train_step(state))
        job.commit(step)


if __name__ == "__main__":
    main()
