"""Weight sync from device memory: ``WeightSync.push`` of a ~1B-parameter bf16 model on the
GPU (gather, pack on the GPU, down through the pinned staging buffers, send, the engine's
acknowledgement) to one receiver in another process, beside the physical limit of that
path measured in the same run: one device-to-host copy of the same bytes into pinned
memory. The default ``Config``: the engine on this host is reached over shared memory, the
leader's packed version sits in pinned shared memory (the GPU copies each bucket down into
it on a stream of its own) and is offered where it lies; the engine copies and hashes it on
its CPU threads. Medians of a few pushes; bench/results/weight_sync_gpu.{json,md}."""

from __future__ import annotations

import logging
import statistics
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from bench_results import copy_seconds, machine, write_results
from torch import nn

from support.children import spawn

pytestmark = pytest.mark.gpu

DIM, LAYERS = 8192, 16  # 1.07e9 parameters, 2 GiB in bf16
ROUNDS = 5
TOKEN = b"gpu-weight-sync-bench"
# The default Config (its backends: shared memory between processes of one host).
CONFIG = {"timeout": timedelta(seconds=120)}

_results: dict[str, dict] = {}


def _config():
    import replica

    return replica.Config(token=TOKEN, **CONFIG)


def _engine(pipe, port: int) -> None:
    from replica.weights import WeightReceiver

    logging.basicConfig(level=logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    receiver = WeightReceiver(index=0, store=store, config=_config())
    pipe.send(("ready",))
    pipe.recv()  # exit
    receiver.close()
    pipe.send(("bye",))


def test_gpu_weight_sync(benchmark):
    from replica.weights import WeightSync

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))).to("cuda", torch.bfloat16)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    with spawn(_engine, store.port, name="engine") as engine:
        assert engine.recv(120) == ("ready",)
        sync = WeightSync(model, store=store, num_engines=1, config=_config())
        step = iter(range(1, 1000))

        def push() -> None:
            stats = sync.push(next(step))
            assert stats.engines_synced == [0], stats.engines_skipped

        push()  # warm-up: connections, staging buffers
        benchmark.extra_info.update(params=DIM * DIM * LAYERS, bytes=sync.layout.total_bytes)
        benchmark.pedantic(push, rounds=ROUNDS, iterations=1)
        push_s = sync.stats.push_s[1:]
        nbytes = sync.layout.total_bytes
        backend = type(next(iter(sync._links.values())).transport).__name__ if sync._links else "?"
        sync.close()
        engine.send("exit")
        assert engine.recv(120) == ("bye",)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    push, d2h = statistics.median(push_s), copy_seconds(host, flat, rounds=5)
    result = {
        "bytes": nbytes,
        "backend": backend,
        "push_ms": push * 1e3,
        "push_GBps": nbytes / push / 1e9,
        "d2h_pinned_GBps": nbytes / d2h / 1e9,
        "push_vs_d2h": d2h / push,
        "push_ms_all": [s * 1e3 for s in push_s],
        "device": torch.cuda.get_device_name(),
        "machine": machine(),
        "config": repr(CONFIG),
    }
    write_results(
        "weight_sync_gpu",
        result,
        [
            f"### weight sync from GPU memory, {DIM * DIM * LAYERS / 1e9:.2f}B bf16 parameters "
            f"({nbytes / 2**30:.2f} GiB), one engine process, {torch.cuda.get_device_name()} (medians of {ROUNDS})\n",
            "| path | ms | GB/s | vs limit |",
            "|---|---|---|---|",
            f"| push: gather + pack + down + send ({backend}) + ack | {push * 1e3:.1f} | {nbytes / push / 1e9:.1f} | "
            f"{d2h / push:.2f}x |",
            f"| limit: one device-to-host copy into pinned memory | {d2h * 1e3:.1f} | "
            f"{nbytes / d2h / 1e9:.1f} | 1.00x |",
        ],
    )
