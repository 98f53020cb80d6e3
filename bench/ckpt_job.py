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
import torch.distributed.checkpoint as dcp
from fsdp_job import JobShape, build_job, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import replica


def main() -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    root, every, steps = Path(os.environ["CKPT_DIR"]), int(os.environ["CKPT_EVERY"]), int(os.environ["STEPS"])
    kill_at = int(os.environ.get("KILL_AT", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job = build_job(JobShape(total_steps=steps), rank=rank, world_size=world)
    first = 1
    if os.environ.get("RESUME"):
        done = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / ".done").exists())
        if done:
            last = done[-1]
            model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=root / str(last))
            set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            extras = torch.load(root / str(last) / f"extras.{rank}.pt", weights_only=False)
            for name, obj in job.extra.items():
                obj.load_state_dict(extras[name])
            first = last + 1
    progress = open(root / f"progress.{rank}", "a")
    for step in range(first, steps + 1):
        if step == kill_at and rank == 1:
            (root / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(job)
        if step % every == 0:
            model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / str(step))
            torch.save({name: obj.state_dict() for name, obj in job.extra.items()},
                       root / str(step) / f"extras.{rank}.pt")
            dist.barrier()
            if rank == 0:
                (root / str(step) / ".done").write_text("")
        progress.write(f"{step} {time.time()!r}\n")
        progress.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert replica.__version__  # the same environment as the replica runs
    main()
