"""The checkpoint-restart baseline of bench/test_failover.py: the demo job on
plain gloo + FSDP2, saving a torch.distributed.checkpoint every CKPT_EVERY steps.
Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CKPT_DIR, CKPT_EVERY,
STEPS, and either KILL_AT (rank 1 SIGKILLs itself at the start of that step) or
RESUME=1 (load the newest checkpoint and continue). Each rank appends
"step time" lines to CKPT_DIR/progress.{rank}."""

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_checkpoint import Checkpoints
from fsdp_job import JobShape, build_job, train_step

import replica


def main() -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    root, steps = Path(os.environ["CKPT_DIR"]), int(os.environ["STEPS"])
    checkpoints = Checkpoints(root, int(os.environ["CKPT_EVERY"]))
    kill_at = int(os.environ.get("KILL_AT", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job = build_job(JobShape(total_steps=steps), rank=rank, world_size=world)
    first = 1
    if os.environ.get("RESUME") and (last := checkpoints.newest()) is not None:
        checkpoints.load(last, job.model, job.optimizer, job.extra, rank=rank)
        first = last + 1
    progress = open(root / f"progress.{rank}", "a")  # noqa: SIM115 - written step by step until the job ends
    for step in range(first, steps + 1):
        if step == kill_at and rank == 1:
            (root / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(job)
        if checkpoints.due(step):
            checkpoints.save(step, job.model, job.optimizer, job.extra, rank=rank)
        progress.write(f"{step} {time.time()!r}\n")
        progress.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert replica.__version__  # the same environment as the replica runs
    main()
