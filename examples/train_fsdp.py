"""The demo job: a tiny FSDP2 transformer, run by `replica launch` in every role
(trainers and standbys run this same file). On CPU by default; `--device cuda`
puts every role on a GPU (rank r on GPU r mod the GPUs visible), with the
settings that make a GPU run repeatable bit for bit. ``--checkpoint-dir D
--checkpoint-every K``: the checkpoint-restart baseline (examples/dcp_checkpoint.py)."""

import argparse

import torch
from dcp_checkpoint import Checkpoints, add_arguments  # beside this file
from fsdp_job import JobShape, build_job, role_device, train_step  # beside this file

import replica.roles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_arguments(parser)
    args = parser.parse_args()
    checkpoints = Checkpoints.of(parser, args)
    torch.set_num_threads(1)
    device = role_device(args.device)
    job = replica.roles.init()
    total = job.env.steps  # replica launch --steps
    shape = JobShape(total_steps=total)
    state = build_job(shape, rank=job.rank, world_size=job.env.world_size, device=device)
    if checkpoints is not None:
        checkpoints.restore(job, state.model, state.optimizer, state.extra)
    job.replicate(state.model, state.optimizer, state.extra)
    for step in job.steps(total):
        loss = train_step(state)
        job.log(step, loss)
        job.commit(step)
        if checkpoints is not None:
            checkpoints.after(step, state.model, state.optimizer, state.extra, rank=job.rank)


if __name__ == "__main__":
    main()
