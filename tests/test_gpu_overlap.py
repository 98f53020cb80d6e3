"""On a GPU the mirror runs beside the step, not after it: work the trainer queues
right after ``commit()`` (its next step) must not hold back the stream of the step just
committed, nor a weight push work queued on other streams. Checked by order, not by
wall-clock ratios: a kernel queued right after the commit (``torch.cuda._sleep`` for
seconds) must still be running when the stream's global commit is seen.

Both placements of the mirror: GPU memory (CUDA IPC) and pinned host memory (shared
memory); in both the trainer's process pushes the buckets into the standby's buffers
(the standby's process does no GPU work, so its context's time slices never wait for
the trainer's kernels)."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import replica
from replica.config import DEVICE_BUCKET_BYTES
from support.children import spawn

pytestmark = pytest.mark.gpu

TOKEN = b"gpu-overlap-token"
# About 4 s of one SM on an H100 or H200 (~2 GHz): far longer than a 768 MiB stream
# (milliseconds into GPU memory, tens into host memory), short enough for CI.
SLEEP_CYCLES = 8_000_000_000
T = timedelta(seconds=120)


def _config(**kw) -> replica.Config:
    return replica.Config(token=TOKEN, timeout=T, commit_timeout=T, **kw)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 4 x 4096^2 fp32 parameters (256 MiB) + AdamW's two moments: a 768 MiB snapshot,
    # a dozen of the default Config's 64 MiB buckets.
    return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(4))).cuda()


def _train(model, optimizer) -> None:
    x = torch.randn(256, 4096, device="cuda")
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _standby(pipe, port: int, device: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    mirror = replica.Mirror(rank=0, world_size=1, store=store, config=_config(), device=device)
    pipe.send(("ready", mirror.backend))
    pipe.recv()  # exit
    mirror.close()
    pipe.send(("bye",))


@pytest.mark.parametrize("mirror", ["cuda", "cpu"], ids=["gpu-memory", "host-memory"])
def test_a_kernel_queued_right_after_commit_does_not_delay_the_stream(mirror):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    with contextlib.ExitStack() as stack:
        standby = stack.enter_context(spawn(_standby, store.port, mirror, name=f"standby-{mirror}"))
        status, backend = standby.recv(120)
        assert status == "ready" and backend == ("ipc" if mirror == "cuda" else "shm")
        rep = stack.enter_context(
            replica.Replicator(model, optimizer, {}, store=store, config=_config(), rank=0, world_size=1)
        )
        assert rep.config.bucket_bytes is None  # the default: sized for the device
        # Step 1: connects, maps the standby's buffers; not timed.
        _train(model, optimizer)
        assert rep.commit(1)
        assert rep.wait_committed() == 1
        assert len(rep.layout.buckets()) >= 8 and rep.layout.bucket_bytes == DEVICE_BUCKET_BYTES
        for step in (2, 3):
            _train(model, optimizer)
            assert rep.commit(step)
            # The next step's work, queued on the trainer's stream right after the commit.
            torch.cuda._sleep(SLEEP_CYCLES)
            slept = torch.cuda.Event()
            slept.record()
            assert rep.wait_committed() == step
            assert not slept.query(), (
                f"step {step}'s stream finished only after the kernel queued behind its "
                "commit: it waited for the trainer's next step"
            )
            slept.synchronize()
        conn = rep._stream._conn
        # Every bucket of every stream went the trainer's way: pushed from its process.
        assert conn.pushed_sends == 3 * len(rep.layout.buckets()), conn.pushed_sends
        assert conn.num_exports == 0  # nothing was offered for the standby to copy
        standby.send("exit")
        assert standby.recv(120) == ("bye",)


def test_a_weight_push_waits_for_its_own_work_only():
    """A push gathers and packs on the caller's stream and copies down on its own; a long
    kernel on another stream (other work of the trainer's process) must not hold it back."""
    from replica.weights import WeightSync
    from support.weight_engine import EngineStandIn

    config = _config(backends=("gloo",))
    model = _model()
    store = dist.HashStore()
    engine = EngineStandIn(0, store, config=config, wait=T)
    sync = WeightSync(model, store=store, num_engines=1, config=config)
    try:
        assert sync.push(1).engines_synced == [0] and engine.sync(1) == 1
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            slept = torch.cuda.Event()
            slept.record(side)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
        assert sync.push(2).engines_synced == [0]
        assert not slept.query(), "the push waited for a kernel on another stream"
        assert engine.sync(2) == 2
        for name, p in model.named_parameters():
            assert torch.equal(engine.weights[name], p.detach().cpu()), name
        slept.synchronize()
    finally:
        sync.close()
        engine.receiver.close()
