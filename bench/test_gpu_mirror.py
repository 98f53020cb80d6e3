"""Mirror overhead on a GPU: a ~1B-parameter model (bf16 parameters, default AdamW,
whose step counters stay on the host) trained on one GPU, step time with and without
``Replicator.commit`` to a standby process on the same GPU, medians in one run, with
the **default** ``Config`` (what a user gets without tuning). Two step lengths: a short
step (4,096 tokens, ~53 ms on an H100: the stream outlasts it) and a long one (32,768
tokens, ~340 ms: the stream should hide behind it entirely). The standby holds its
mirror in GPU memory (CUDA IPC) or in pinned host memory (shared memory); either way
the trainer's process pushes the buckets into the standby's buffers on a copy stream.

Per placement and step: the step with and without ``commit()``, the overhead, the
stream's time and bandwidth while the trainer computes, and the stream's time with the
trainer idle (commits with no step between, in the same run): how much the step slows
the stream. Beside them the physical limits measured in the same run: one
device-to-device ``copy_`` of the snapshot (the pack) and one device-to-host ``copy_``
into pinned memory (a host mirror's stream).

One GPU serves both processes: the standby's buffers share the trainer's memory
bandwidth, which a standby on a rollout machine's GPU would not. Writes
bench/results/mirror_gpu.json and mirror_gpu.md."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from bench_results import copy_seconds, machine, write_results
from torch import nn

from support.children import spawn

pytestmark = pytest.mark.gpu

DIM, LAYERS = 8192, 16  # 16 x 8192^2 = 1.07e9 parameters
STEPS = {"short": 4096, "long": 32768}  # tokens per step
WARMUP, MEASURED, IDLE = 3, 8, 3
TOKEN = b"gpu-mirror-bench"
# The default Config: only the token and deadlines long enough for a 6 GiB first stream.
CONFIG = {"timeout": timedelta(seconds=120), "commit_timeout": timedelta(seconds=300)}
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
    """One training step per call (timed by itself), optionally committed."""

    def __init__(self, model, optimizer, commit=None):
        self.model, self.optimizer, self.commit = model, optimizer, commit
        self.step = 0
        self.seconds: dict[str, list[float]] = {name: [] for name in STEPS}
        self.x = {name: torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16) for name, tokens in STEPS.items()}

    def run(self, name: str) -> None:
        self.step += 1
        start = time.perf_counter()
        loss = self.model(self.x[name]).float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the step is done when its loss is known
        if self.commit is not None:
            self.commit(self.step)
        self.seconds[name].append(time.perf_counter() - start)


@pytest.fixture(scope="module")
def trainer():
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_gpu_step_plain(benchmark, trainer):
    loop = _Loop(*trainer)
    benchmark.extra_info.update(kind="plain", params=DIM * DIM * LAYERS)

    def run():
        for name in STEPS:
            for _ in range(WARMUP + MEASURED):
                loop.run(name)

    benchmark.pedantic(run, rounds=1, iterations=1)
    _results["plain"] = {name: loop.seconds[name][WARMUP:] for name in STEPS}


@pytest.mark.parametrize("mirror", MIRRORS)
def test_gpu_step_mirrored(benchmark, trainer, mirror):
    import replica

    model, optimizer = trainer
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    with contextlib.ExitStack() as stack:
        standby = stack.enter_context(spawn(_standby, store.port, mirror, name=f"standby-{mirror}"))
        kind, backend = standby.recv(180)
        assert kind == "ready"
        rep = stack.enter_context(
            replica.Replicator(model, optimizer, {}, store=store, config=_config(), rank=0, world_size=1)
        )
        loop = _Loop(model, optimizer, commit=rep.commit)
        benchmark.extra_info.update(kind="mirrored", mirror=mirror, backend=backend)
        streams: dict[str, list[float]] = {}
        parts: dict[str, dict[str, list[float]]] = {}  # where each stream's time went (StreamStats)

        def run():
            for name in STEPS:
                first = len(rep.stream_stats.stream_s)
                for _ in range(WARMUP + MEASURED):
                    loop.run(name)
                rep.wait_committed()
                # The streams of the measured steps (each ran beside the next step; the
                # last one's beside nothing, so it is left out).
                kept = slice(first + WARMUP, first + WARMUP + MEASURED - 1)
                streams[name] = rep.stream_stats.stream_s[kept]
                parts[name] = {part: getattr(rep.stream_stats, part)[kept] for part in ("post_s", "flush_s", "reply_s")}
            # The trainer idle: commits with no step between, each waited for.
            first = len(rep.stream_stats.stream_s)
            for _ in range(IDLE):
                loop.step += 1
                rep.commit(loop.step)
                rep.wait_committed()
            streams["idle"] = rep.stream_stats.stream_s[first:]

        benchmark.pedantic(run, rounds=1, iterations=1)
        assert rep.wait_committed() == loop.step  # every step was mirrored and acknowledged
        conn = rep._stream._conn
        _results[mirror] = {
            "backend": backend,
            "step_s": {name: loop.seconds[name][WARMUP:] for name in STEPS},
            "stream_s": streams,
            "parts": parts,
            "pack_s": rep.stats.pack_s[WARMUP:],
            "snapshot_bytes": rep.layout.total_bytes,
            "bucket_bytes": rep.layout.bucket_bytes,
            "pushed_sends": getattr(conn, "pushed_sends", None),
        }
        standby.send("exit")
        assert standby.recv(120) == ("bye",)
    nbytes = _results[mirror]["snapshot_bytes"]
    # The physical limits, in the same run: one device-to-device copy of the snapshot's
    # bytes (the pack), one device-to-host copy into pinned memory (a host mirror's stream).
    if "copy" not in _results:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        _results["copy"] = {
            "d2d": copy_seconds(torch.empty_like(src), src),
            "d2h": copy_seconds(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), src),
        }


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if "plain" not in _results or not any(m in _results for m in MIRRORS):
        return
    limits = _results["copy"]
    device = torch.cuda.get_device_name()
    result = {
        "params": DIM * DIM * LAYERS,
        "tokens": STEPS,
        "device": device,
        "machine": machine(),
        "config": "default Config() " + repr(CONFIG),
        "d2d_copy_ms": limits["d2d"] * 1e3,
        "d2h_copy_ms": limits["d2h"] * 1e3,
        "mirrors": {},
    }
    lines = [
        f"### GPU mirror overhead, {DIM * DIM * LAYERS / 1e9:.2f}B-parameter bf16 model + AdamW on one "
        f"{device}, default `Config` (medians of {MEASURED} steps)\n",
        "| mirror in | over | step | no mirror | with commit() | overhead | stream beside the step | "
        "stream, trainer idle | beside / idle | idle vs its limit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mirror in MIRRORS:
        if mirror not in _results:
            continue
        r = _results[mirror]
        nbytes = r["snapshot_bytes"]
        idle = statistics.median(r["stream_s"]["idle"])
        limit = limits["d2d" if mirror == "cuda" else "d2h"]
        entry = {
            "backend": r["backend"],
            "snapshot_bytes": nbytes,
            "bucket_bytes": r["bucket_bytes"],
            "pushed_sends": r["pushed_sends"],
            "pack_ms": statistics.median(r["pack_s"]) * 1e3,
            "idle_stream_ms": idle * 1e3,
            "idle_stream_GBps": nbytes / idle / 1e9,
            "idle_vs_limit": limit / idle,
            "steps": {},
        }
        for name in STEPS:
            plain = statistics.median(_results["plain"][name])
            step = statistics.median(r["step_s"][name])
            stream = statistics.median(r["stream_s"][name])
            entry["steps"][name] = {
                "step_ms_plain": plain * 1e3,
                "step_ms": step * 1e3,
                "overhead_pct": (step / plain - 1) * 100,
                "stream_ms": stream * 1e3,
                "stream_GBps": nbytes / stream / 1e9,
                "stream_vs_idle": idle / stream,
                "step_ms_all": [s * 1e3 for s in r["step_s"][name]],
                # until the last bucket was posted / every send finished / the standby's answer
                **{
                    f"{part[:-2]}_ms": statistics.median(r["parts"][name][part]) * 1e3
                    for part in ("post_s", "flush_s", "reply_s")
                },
                "stream_ms_all": [s * 1e3 for s in r["stream_s"][name]],
            }
            m = entry["steps"][name]
            where = "GPU memory" if mirror == "cuda" else "pinned host memory"
            lines.append(
                f"| {where} | {r['backend']} | {name} ({STEPS[name]} tokens) | {m['step_ms_plain']:.1f} ms | "
                f"{m['step_ms']:.1f} ms | {m['overhead_pct']:+.1f}% | {m['stream_ms']:.1f} ms "
                f"({m['stream_GBps']:.1f} GB/s) | {idle * 1e3:.1f} ms ({nbytes / idle / 1e9:.1f} GB/s) | "
                f"{m['stream_vs_idle']:.2f}x | {limit / idle:.2f}x of one {'D2D' if mirror == 'cuda' else 'D2H'} "
                f"copy_ ({nbytes / limit / 1e9:.1f} GB/s) |"
            )
        result["mirrors"][mirror] = entry
    lines.append(
        f"\nSnapshot {nbytes / 2**30:.2f} GiB in {r['bucket_bytes'] >> 20} MiB buckets; pack "
        f"{statistics.median(r['pack_s']) * 1e3:.2f} ms against one D2D copy_ {limits['d2d'] * 1e3:.2f} ms."
    )
    write_results("mirror_gpu", result, lines)
