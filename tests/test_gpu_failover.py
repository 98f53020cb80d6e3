"""End to end on one GPU: `replica launch` runs examples/train_fsdp.py with every role on
the GPU (an FSDP2 trainer of world size 1 over the resilient group's NCCL generation,
default non-fused AdamW whose step counters stay on the host, dropout on the CUDA RNG),
its standby on the same GPU. The trainer is killed (SIGKILL) in the backward of a step;
the standby is promoted and the losses equal the failure-free run's bit for bit. Twice:
the mirror in GPU memory (CUDA IPC between the two processes) and in pinned host memory
(UCX from device to host; the promotion copies the state to the GPU).

Two trainer ranks cannot share one GPU under NCCL, so the multi-rank NCCL path is not
run here; tests/test_gpu_resilient.py covers the NCCL generation of world size 1."""

from __future__ import annotations

import math

import pytest
import torch

from replica.roles.report import compare_reports
from support.launch import launch

pytestmark = pytest.mark.gpu

STEPS = 8
KILL_AT = 5
ARGS = ("--trainers", "1", "--heartbeat-deadline", "10")
GPU = ("--device", "cuda")
LOG = {"REPLICA_LOG": "INFO"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    code, report, output = launch(
        tmp_path_factory.mktemp("gpu-reference"), *ARGS, name="reference", steps=STEPS, script_args=GPU
    )
    assert code == 0, output[-6000:]
    assert report["failovers"] == [] and report["last_commit"] == STEPS
    losses = [float.fromhex(h) for h in report["losses_hex"]["0"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    return report


def test_reference_runs_are_repeatable(tmp_path, reference):
    """The bar below means something only if two failure-free GPU runs agree bit for bit."""
    code, report, output = launch(tmp_path, *ARGS, name="again", steps=STEPS, script_args=GPU)
    assert code == 0, output[-6000:]
    assert compare_reports(reference, report) == []


# On one node a mirror on the GPU streams over CUDA IPC, one in host memory over shared
# memory (the trainer's device buckets exported, copied down by the standby), or over UCX
# where the job says so (--backends ucx,gloo: as to a standby on another node).
@pytest.mark.parametrize(
    "mirror,backend,backends", [("model", "ipc", ""), ("cpu", "shm", ""), ("cpu", "ucx", "ucx,gloo")]
)
def test_gpu_trainer_killed_standby_promoted(tmp_path, reference, mirror, backend, backends):
    if backend == "ucx":
        pytest.importorskip("ucxx", reason="the host mirror of a GPU model streams over UCX")
    code, report, output = launch(
        tmp_path,
        *ARGS,
        "--mirror-device",
        mirror,
        *(["--backends", backends] * bool(backends)),
        "--inject",
        f"kill:trainer:0@{KILL_AT}:backward",
        steps=STEPS,
        script_args=GPU,
        env=LOG,
    )
    assert code == 0, output[-6000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]  # the kill fired
    (failover,) = report["failovers"]
    assert failover["rank"] == 0 and failover["commit"] in (KILL_AT - 2, KILL_AT - 1), failover
    assert f"over {backend}" in output, output[-6000:]  # the mirror took the path under test
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS
    print(f"mirror={mirror} over {backend}: failover timeline (ms) {failover['timeline_ms']}")


def test_the_gpu_is_there():
    """Guards against a silently CPU-only run of this module."""
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
