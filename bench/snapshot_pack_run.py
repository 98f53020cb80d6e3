"""The snapshot pack against a memcpy of the same bytes, in one process alone: the
FSDP2 job of bench/test_mirror.py at world size 1 (its whole state on one rank),
measured as the benchmark measures it in each trainer (``mirror_roles.Probe.pack``:
every cache emptied before each call, the sources just read or evicted, in turns).

    cd bench && ../.venv/bin/python snapshot_pack_run.py [ROUNDS]

Prints the medians and ratios, and the JSON of the samples on the last line."""

from __future__ import annotations

import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
from fsdp_job import build_job, train_step  # noqa: E402
from mirror_jobs import SHAPE  # noqa: E402  (bench/, the script's folder)

from replica import StateLayout  # noqa: E402
from support.mirror_roles import Probe  # noqa: E402
from support.ports import free_port  # noqa: E402


def main(rounds: int) -> None:
    torch.set_num_threads(1)  # as the benchmark's trainers
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        job = build_job(SHAPE, rank=0, world_size=1, seed=0)
        train_step(job)
        layout = StateLayout.of(
            job.model, job.optimizer, world_size=1, rank=0, extras_capacity=1 << 20, bucket_bytes=1 << 20
        )
        seconds = Probe().pack(job, layout, rounds, shared=True)
    finally:
        dist.destroy_process_group()
    ms = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    print(f"{len(layout.entries)} tensors, {layout.total_bytes / 2**20:.1f} MiB, {rounds} rounds")
    for state in ("hot", "cold"):
        print(
            f"sources {state}: pack {ms[f'pack_{state}_s']:.3f} ms, memcpy {ms[f'memcpy_{state}_s']:.3f} ms: "
            f"{ms[f'memcpy_{state}_s'] / ms[f'pack_{state}_s']:.2f}x"
        )
    print(json.dumps(seconds))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
