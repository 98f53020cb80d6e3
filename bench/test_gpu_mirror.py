"""Mirror overhead on a GPU: a ~1B-parameter model (bf16 parameters, default AdamW,
whose step counters stay on the host) trained on one GPU, step time with and without
``Replicator.commit`` to a standby process on the same GPU, medians in one run. The
standby holds its mirror in GPU memory (CUDA IPC) or in pinned host memory (UCX,
device to host). Beside it: the snapshot (pack) time against a device-to-device
``copy_`` of the same bytes, and the mirror stream's bandwidth.

One GPU serves both processes: the standby's copies compete with the trainer's
kernels for the same memory bandwidth, which a standby on a rollout machine's GPU
would not. Writes bench/results/mirror_gpu.json and mirror_gpu.md."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from bench_results import machine, write_results
from torch import nn

from replica.testing import spawn

pytestmark = pytest.mark.gpu

DIM, LAYERS, TOKENS = 8192, 16, 4096  # 16 x 8192^2 = 1.07e9 parameters
WARMUP, STEPS = 3, 12
TOKEN = b"gpu-mirror-bench"
CONFIG = {"bucket_bytes": 64 << 20, "backends": ("ipc", "ucx", "gloo"), "timeout": timedelta(seconds=120),
          "commit_timeout": timedelta(seconds=300)}
MIRRORS = ["cuda", "cpu"]

_results: dict[str, dict] = {}


def _config():
    import replica

    return replica.Config(token=TOKEN, **CONFIG)


def _standby(pipe, port: int, device: str) -> None:
    import replica

    logging.basicConfig(level=logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    mirror = replica.Mirror(rank=0, world_size=1, store=store, config=_config(), device=device)
    pipe.send(("ready", mirror.backend))
    pipe.recv()  # exit
    mirror.close()
    pipe.send(("bye",))


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM, bias=False), nn.GELU()]
    return nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)


class _Loop:
    """One training step per call (timed by pytest-benchmark and by itself), optionally committed."""

    def __init__(self, model, optimizer, commit=None):
        self.model, self.optimizer, self.commit = model, optimizer, commit
        self.x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
        self.step = 0
        self.seconds: list[float] = []

    def __call__(self) -> None:
        self.step += 1
        start = time.perf_counter()
        loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the step is done when its loss is known
        if self.commit is not None:
            self.commit(self.step)
        self.seconds.append(time.perf_counter() - start)


@pytest.fixture(scope="module")
def trainer():
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_gpu_step_plain(benchmark, trainer):
    loop = _Loop(*trainer)
    benchmark.extra_info.update(kind="plain", params=DIM * DIM * LAYERS)
    benchmark.pedantic(loop, rounds=WARMUP + STEPS, iterations=1)
    _results["plain"] = {"step_s": loop.seconds[WARMUP:]}


@pytest.mark.parametrize("mirror", MIRRORS)
def test_gpu_step_mirrored(benchmark, trainer, mirror):
    import replica

    if mirror == "cpu":
        pytest.importorskip("ucxx", reason="a host mirror of a GPU model streams over UCX")
    model, optimizer = trainer
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    with contextlib.ExitStack() as stack:
        standby = stack.enter_context(spawn(_standby, store.port, mirror, name=f"standby-{mirror}"))
        kind, backend = standby.recv(120)
        assert kind == "ready"
        rep = stack.enter_context(replica.Replicator(model, optimizer, {}, store=store, config=_config(), rank=0,
                                                     world_size=1))
        loop = _Loop(model, optimizer, commit=rep.commit)
        benchmark.extra_info.update(kind="mirrored", mirror=mirror, backend=backend)
        benchmark.pedantic(loop, rounds=WARMUP + STEPS, iterations=1)
        assert rep.wait_committed() == WARMUP + STEPS  # every step was mirrored and acknowledged
        nbytes = rep.layout.total_bytes
        steady = slice(WARMUP, None)
        _results[mirror] = {
            "backend": backend,
            "step_s": loop.seconds[steady],
            "pack_s": rep.stats.pack_s[steady],
            "wait_s": rep.stats.wait_s[steady],
            "stream_s": rep.stream_stats.stream_s[steady],
            "snapshot_bytes": nbytes,
        }
        standby.send("exit")
        assert standby.recv(120) == ("bye",)
    # The physical limit of the pack: one device-to-device copy of the snapshot's bytes.
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t)
    _results["copy"] = {"copy_s": statistics.median(copies[2:])}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if "plain" not in _results or not any(m in _results for m in MIRRORS):
        return
    plain = statistics.median(_results["plain"]["step_s"])
    copy_s = _results["copy"]["copy_s"]
    result = {"step_ms_plain": plain * 1e3, "params": DIM * DIM * LAYERS, "tokens": TOKENS,
              "device": torch.cuda.get_device_name(), "machine": machine(), "config": repr(CONFIG), "mirrors": {}}
    lines = [f"### GPU mirror overhead, {DIM * DIM * LAYERS / 1e9:.2f}B-parameter bf16 model + AdamW on one "
             f"{torch.cuda.get_device_name()} (medians of {STEPS} steps)\n",
             "| standby holds the mirror in | over | step, no mirror | step with commit() | overhead | "
             "pack (snapshot) | pack vs D2D copy_ | stream (send, verify, ack) |",
             "|---|---|---|---|---|---|---|---|"]
    for mirror in MIRRORS:
        if mirror not in _results:
            continue
        r = _results[mirror]
        nbytes = r["snapshot_bytes"]
        step = statistics.median(r["step_s"])
        pack = statistics.median(r["pack_s"])
        stream = statistics.median(r["stream_s"])
        result["mirrors"][mirror] = {
            "backend": r["backend"], "step_ms": step * 1e3, "overhead_pct": (step / plain - 1) * 100,
            "pack_ms": pack * 1e3, "pack_GBps": nbytes / pack / 1e9, "copy_GBps": nbytes / copy_s / 1e9,
            "pack_vs_copy": copy_s / pack, "commit_wait_ms": statistics.median(r["wait_s"]) * 1e3,
            "stream_ms": stream * 1e3, "stream_GBps": nbytes / stream / 1e9, "snapshot_bytes": nbytes,
            "step_ms_all": [s * 1e3 for s in r["step_s"]],
        }
        m = result["mirrors"][mirror]
        where = "GPU memory" if mirror == "cuda" else "pinned host memory"
        lines.append(f"| {where} | {m['backend']} | {plain * 1e3:.1f} ms | {m['step_ms']:.1f} ms | "
                     f"{m['overhead_pct']:+.1f}% | {m['pack_ms']:.2f} ms ({m['pack_GBps']:.0f} GB/s, "
                     f"{nbytes / 2**30:.2f} GiB) | {m['pack_vs_copy']:.2f}x ({m['copy_GBps']:.0f} GB/s) | "
                     f"{m['stream_ms']:.1f} ms ({m['stream_GBps']:.1f} GB/s) |")
    write_results("mirror_gpu", result, lines)
