"""Mirror overhead on the training loop: the FSDP2 job of the tests on 2 CPU
ranks (gloo), step time with and without ``Replicator.commit`` (2 standby
processes, real UCX), medians in one run; beside it the snapshot (pack) time
and the mirror's bandwidth next to raw UCX and memcpy for the same bytes.
`make bench` writes bench/results/mirror.json and mirror.md.

All processes share this machine's cores: the standbys' receive and digest
work competes with the trainers' compute, which a standby on a rollout machine
would not. The overhead measured here is therefore an upper bound."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import statistics
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench_results import machine, write_results
from fsdp_job import JobShape
from mirror_roles import standby_main, trainer_main
from replica.testing import spawn
from replica.transport.base import bucket_digest
from test_resync import _make_ucx, _transport_path

SHAPE = JobShape(dim=128, layers=4, seq=64, batch=16, samples=4096, total_steps=10_000)
CONFIG = {"bucket_bytes": 1 << 20}
WORLD = 2
WARMUP, STEPS = 5, 30
KINDS = ["plain", "mirrored"]

_results: dict[str, dict] = {}


class _Job:
    def __init__(self, trainers):
        self.trainers = trainers
        self.step = 0
        self.seconds: list[float] = []

    def run_step(self) -> None:
        self.step += 1
        for t in self.trainers:
            t.send("step", self.step, None)
        took = []
        for t in self.trainers:
            kind, at, _, seconds = t.recv(300)
            assert (kind, at) == ("loss", self.step)
            took.append(seconds)
        self.seconds.append(max(took))  # the ranks are in lock step: the slower one is the step


SMOKE_PARAMS = {"job": {"mirrored"}}  # `make test`: the mirrored job only (the plain one: `make bench`)


@pytest.fixture(scope="module", params=KINDS)
def job(request):
    mirrored = request.param == "mirrored"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = store.port
    with contextlib.ExitStack() as stack:
        children = []
        if mirrored:
            children += [stack.enter_context(spawn(standby_main, r, WORLD, port, SHAPE, CONFIG, name=f"standby{r}"))
                         for r in range(WORLD)]
        trainers = [stack.enter_context(spawn(trainer_main, r, WORLD, port, SHAPE, CONFIG if mirrored else None,
                                              name=f"trainer{r}")) for r in range(WORLD)]
        for child in children + trainers:
            assert child.recv(180)[0] == "ready"
        driver = _Job(trainers)
        yield request.param, driver
        if mirrored:
            _results["stats"] = trainers[0].request("stats", timeout=60)[1]
        for child in trainers + children:
            child.send("exit")
    del store


def test_step(benchmark, job):
    kind, driver = job
    for _ in range(0 if benchmark.disabled else WARMUP):
        driver.run_step()
    driver.seconds.clear()
    benchmark.extra_info.update(kind=kind, world_size=WORLD, shape=repr(SHAPE))
    benchmark.pedantic(driver.run_step, rounds=2 if benchmark.disabled else STEPS, iterations=1)
    if not benchmark.disabled:
        _results[kind] = {"step_s": list(driver.seconds)}


def test_raw_transport_same_bytes(benchmark):
    """Raw UCX (digests on, as the mirror) and memcpy for one snapshot's bytes."""
    nbytes = _results.get("stats", {}).get("snapshot_bytes", 8 << 20)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    rounds = 1 if benchmark.disabled else 30  # a disabled benchmark runs the function once
    with _transport_path("ucx_verified", functools.partial(_make_ucx, "^cma,knem,xpmem", True), "cpu") as path:
        _, peer, one_round = path
        assert peer.request("size", nbytes) == ("ok",)
        peer.send("rounds", rounds)
        benchmark.extra_info.update(path="ucx_verified", bytes=nbytes)
        benchmark.pedantic(one_round, args=(buf, bucket_digest(buf)), rounds=rounds, iterations=1)
        assert peer.recv(timeout=300) == ("ok",)
    if benchmark.disabled:
        return
    dst = torch.empty_like(buf)
    copies = []
    for _ in range(rounds):
        t = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), buf.data_ptr(), nbytes)
        copies.append(time.perf_counter() - t)
    # Raw UCX without digests, the snapshot's bytes in the mirror's bucket size, all in
    # flight at once: what the mirror stream would move with nothing of its own.
    bucket = CONFIG["bucket_bytes"]
    with _transport_path("ucx_plain", functools.partial(_make_ucx, "^cma,knem,xpmem", False), "cpu") as path:
        _, peer, one_round = path
        assert peer.request("size", nbytes) == ("ok",)
        peer.send("bucketed_rounds", rounds + 2, bucket)
        bucketed = []
        for _ in range(rounds + 2):
            t = time.perf_counter()
            one_round.bucketed(buf, bucket)
            bucketed.append(time.perf_counter() - t)
        assert peer.recv(timeout=300) == ("ok",)
    _results["raw"] = {"bytes": nbytes, "ucx_s": benchmark.stats.stats.median, "memcpy_s": statistics.median(copies),
                       "ucx_plain_bucketed_s": statistics.median(bucketed[2:])}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if not all(k in _results for k in [*KINDS, "stats", "raw"]):
        return  # benchmarks disabled (CI smoke run) or some were deselected
    plain = statistics.median(_results["plain"]["step_s"])
    mirrored = statistics.median(_results["mirrored"]["step_s"])
    stats, raw = _results["stats"], _results["raw"]
    steady = slice(WARMUP, None)
    nbytes = stats["snapshot_bytes"]
    stream_s = statistics.median(stats["stream_s"][steady])
    result = {
        "mirror_overhead_pct": (mirrored / plain - 1) * 100,
        "step_ms_plain": plain * 1e3,
        "step_ms_mirrored": mirrored * 1e3,
        "step_ms_plain_all": [s * 1e3 for s in _results["plain"]["step_s"]],
        "step_ms_mirrored_all": [s * 1e3 for s in _results["mirrored"]["step_s"]],
        "commit_wait_ms": statistics.median(stats["wait_s"][steady]) * 1e3,
        "pack_ms": statistics.median(stats["pack_s"][steady]) * 1e3,
        "snapshot_bytes_per_rank": nbytes,
        "pack_GBps": nbytes / statistics.median(stats["pack_s"][steady]) / 1e9,
        "mirror_stream_ms": stream_s * 1e3,
        "mirror_GBps": nbytes / stream_s / 1e9,
        "raw_ucx_verified_GBps": raw["bytes"] / raw["ucx_s"] / 1e9,
        "raw_ucx_plain_bucketed_GBps": raw["bytes"] / raw["ucx_plain_bucketed_s"] / 1e9,
        "memcpy_GBps": raw["bytes"] / raw["memcpy_s"] / 1e9,
        # The pack takes the snapshot's digests in the same pass (ops.pack_checksum).
        "snapshot_pack_vs_memcpy": raw["memcpy_s"] / statistics.median(stats["pack_s"][steady]),
        # The stream (digests on, verified, acknowledged) against raw UCX without digests in
        # the same bucket size, between two other processes of this machine.
        "mirror_stream_vs_raw_ucx": raw["ucx_plain_bucketed_s"] / stream_s,
        "targets": {"mirror_overhead_pct": 2.0, "snapshot_pack_vs_memcpy": 0.8, "mirror_stream_vs_raw_ucx": 0.8},
        "config": {"shape": repr(SHAPE), "world_size": WORLD, "steps": STEPS, **CONFIG},
        "machine": machine(),
    }
    r = result
    lines = [
        f"### mirror overhead, FSDP2 tiny transformer, {WORLD} CPU ranks + {WORLD} standbys (medians of {STEPS} steps)\n",
        "| figure | value | beside |",
        "|---|---|---|",
        f"| step time, no mirror | {r['step_ms_plain']:.1f} ms | |",
        f"| step time, commit() every step | {r['step_ms_mirrored']:.1f} ms | overhead {r['mirror_overhead_pct']:+.1f}% (target <= 2%) |",
        f"| commit() waiting for the previous global commit | {r['commit_wait_ms']:.2f} ms | |",
        f"| snapshot pack, {nbytes / 2**20:.1f} MiB per rank | {r['pack_ms']:.2f} ms ({r['pack_GBps']:.1f} GB/s) | memcpy {r['memcpy_GBps']:.1f} GB/s |",
        f"| mirror stream (send, verify, ack) | {r['mirror_stream_ms']:.2f} ms ({r['mirror_GBps']:.2f} GB/s) | raw UCX with digests, idle machine: {r['raw_ucx_verified_GBps']:.2f} GB/s |",
        f"| snapshot pack (with digests) vs memcpy of its bytes | {r['snapshot_pack_vs_memcpy']:.2f}x | target >= 0.8x |",
        f"| mirror stream vs raw UCX without digests, {CONFIG['bucket_bytes'] >> 20} MiB buckets "
        f"({r['raw_ucx_plain_bucketed_GBps']:.2f} GB/s) | {r['mirror_stream_vs_raw_ucx']:.2f}x | target >= 0.8x |",
    ]
    write_results("mirror", result, lines)
