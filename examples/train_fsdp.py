"""The demo job: a tiny FSDP2 transformer on CPU, run by `replica launch` in
every role (trainers and standbys run this same file)."""

import os

import torch
from fsdp_job import JobShape, build_job, train_step  # beside this file

import replica.roles


def main() -> None:
    torch.set_num_threads(1)
    job = replica.roles.init()
    total = int(os.environ.get("REPLICA_STEPS", "20"))
    shape = JobShape(total_steps=total)
    state = build_job(shape, rank=job.rank, world_size=job.env.world_size)
    job.replicate(state.model, state.optimizer, state.extra)
    for step in job.steps(total):
        loss = train_step(state)
        job.log(step, loss)
        job.commit(step)


if __name__ == "__main__":
    main()
