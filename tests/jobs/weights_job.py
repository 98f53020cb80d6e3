"""A trainer rank for the weight-sync tests: FSDP2 over gloo, a few training
steps, ``WeightSync.push`` after each. Rank 0 writes each step's full weights
(gathered) as safetensors for the test to compare with what the engine got.
With WEIGHTS_DIE_AT=step:bucket, rank 0 SIGKILLs itself after packing that
bucket of that step's sync (a sender killed mid-sync)."""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import replica
from replica.weights import WeightSync

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp_job import JobShape, build_job, train_step


def main() -> None:
    torch.set_num_threads(1)
    rank, world_size, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["PORT"])
    steps, out = int(os.environ["STEPS"]), Path(os.environ["OUT"])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size)
    job = build_job(JobShape(total_steps=steps), rank=rank, world_size=world_size)
    config = replica.Config(token=b"weights-test-token", bucket_bytes=64 << 10)
    sync = WeightSync(job.model, store=store, num_engines=int(os.environ["ENGINES"]), config=config, rank=rank)
    die_step, _, die_bucket = os.environ.get("WEIGHTS_DIE_AT", "0:0").partition(":")
    if rank == 0 and int(die_step):
        packed, original = [0], sync._pack

        def pack_then_die(full, bucket, offsets):
            original(full, bucket, offsets)
            packed[0] += 1
            if sync.stats.pushes + 1 == int(die_step) and packed[0] > int(die_bucket):
                os.kill(os.getpid(), signal.SIGKILL)

        sync._pack = pack_then_die
    for step in range(1, steps + 1):
        train_step(job)
        full = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in job.model.named_parameters()
        }
        if rank == 0:
            save_file(full, str(out / f"step{step}.safetensors"))
        sync.push(step)
        if rank == 0:
            store.set(f"test/pushed/{step}", " ".join(map(str, sync.stats.engines_synced)))
    sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Out without the interpreter's finalization: about 1 run in 20, a gloo worker thread of
    # torch was still destroying a finished all-gather work (its tensors' Python objects need
    # the GIL) when Py_Finalize began; the thread then exits inside that destructor and the
    # process aborts ("terminate called without an active exception", exit -6; a core showed
    # ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> take_gil -> pthread_exit). Every
    # result of this job is written by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
