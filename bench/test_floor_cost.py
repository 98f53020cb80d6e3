"""The durable floor's cost (issue 56).

* ``test_flush_throughput``: one rank's part written as a standby writes it (``write_export``
  and an fsync of the file and its folder) against ``torch.distributed.checkpoint.save`` of the
  same tensors from one process (what a trainer's DCP checkpoint writes) and against the
  disk's limit measured in the same run (the same bytes in one sequential write); all three as
  durable (the files and their folder synced), in turn within each round. Medians of ROUNDS;
  ratios to the limit. ``make test`` runs it at a small size as a check that the paths work;
  ``make bench`` at SIZE_MIB.
* ``test_flush_cost_per_step`` (``make bench``): the demo job without a floor, with a version
  every step (the worst cadence) and at the default cadence, in turn; a run's mean step time
  (a flush's cost is spread over its steps), the median of ROUNDS runs, and the ratio to the
  run without a floor (the target: <= 1% at the default).

Writes bench/results/floor.{json,md}."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bench_results import machine, write_results
from replica.mirror.floor import FloorConfig, write_part
from replica.state.layout import StateLayout
from replica.state.snapshot import Snapshot
from test_launch import launch

ROUNDS = 5
SIZE_MIB = 512  # make bench: a rank's part of a ~40M-parameter model with AdamW (16 bytes a parameter)
SMOKE_MIB = 16  # make test
TENSORS = 64
JOB_STEPS = 100  # the default cadence writes versions 50 and 100
_results: dict = {}


def _state(size_mib: int) -> list[tuple[str, torch.Tensor]]:
    """``TENSORS`` float32 tensors, ``size_mib`` MiB in all, named as a layout names state."""
    n = size_mib * (1 << 20) // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    return [(f"model.layer{i}.weight", torch.randn(n // 256, 256, generator=g)) for i in range(TENSORS)]


def _snapshot(state: list[tuple[str, torch.Tensor]]) -> Snapshot:
    layout = StateLayout.build(state, world_size=1, rank=0, extras_capacity=4096, bucket_bytes=8 << 20)
    snapshot = Snapshot(layout)
    snapshot.capture([t for _, t in state], b"{}", step=1)
    snapshot.digests = snapshot.compute_digests()
    return snapshot


def _median_seconds(works: dict, rounds: int) -> dict[str, float]:
    """Each of ``works``' median seconds over ``rounds``, taken in turn within each round (the
    disk's speed drifts: one after the other, the first measured would be on another disk)."""
    times: dict[str, list[float]] = {name: [] for name in works}
    for i in range(rounds):
        for name, work in works.items():
            start = time.perf_counter()
            work(i)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_write(path: Path, data: memoryview) -> None:
    """The same bytes as durable as a floor part: one write, the file and its folder synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    _fsync(path)
    _fsync(path.parent)


@pytest.mark.parametrize("size_mib", [SMOKE_MIB, SIZE_MIB], ids=["smoke", "full"])
def test_flush_throughput(benchmark, tmp_path, size_mib):
    if size_mib == SIZE_MIB and benchmark.disabled:
        pytest.skip("the full size runs under `make bench` only")
    rounds = ROUNDS if not benchmark.disabled else 2
    state = _state(size_mib)
    snapshot = _snapshot(state)
    nbytes = snapshot.layout.total_bytes
    raw = memoryview(snapshot.buffer.numpy()).cast("B")

    def floor_part(i: int) -> None:
        write_part(snapshot, tmp_path / f"floor{i}" / "rank00000.safetensors")

    def dcp_save(i: int) -> None:
        dcp.save({"model": dict(state)}, checkpoint_id=str(tmp_path / f"dcp{i}"), no_dist=True)
        folder = tmp_path / f"dcp{i}"
        for f in [*folder.iterdir(), folder]:  # durable, as the floor's part is
            _fsync(f)

    medians = _median_seconds({"limit": lambda i: _raw_write(tmp_path / f"raw{i}" / "part", raw), "floor": floor_part,
                               "dcp": dcp_save}, rounds)
    limit, ours, theirs = medians["limit"], medians["floor"], medians["dcp"]
    assert (tmp_path / "floor0" / "rank00000.safetensors").stat().st_size >= nbytes * 0.99
    gib = nbytes / (1 << 30)
    row = {"size_mib": size_mib, "rounds": rounds, "floor_part_s": ours, "dcp_save_s": theirs, "disk_limit_s": limit,
           "floor_gib_s": gib / ours, "dcp_gib_s": gib / theirs, "disk_gib_s": gib / limit,
           "floor_vs_limit": limit / ours, "floor_vs_dcp": theirs / ours}
    print(f"flush of {size_mib} MiB: floor part {ours:.3f} s ({row['floor_gib_s']:.2f} GiB/s), DCP save "
          f"{theirs:.3f} s ({row['dcp_gib_s']:.2f} GiB/s), the disk's limit {limit:.3f} s ({row['disk_gib_s']:.2f} "
          f"GiB/s): {row['floor_vs_limit']:.0%} of the limit, {row['floor_vs_dcp']:.2f}x DCP")
    if not benchmark.disabled:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures are the medians above
        _results[f"throughput_{size_mib}"] = row


def _mean_step_seconds(report: dict) -> float:
    """Rank 0's seconds a step, from its second step's end to its last (a flush's cost is
    spread over the steps it came in: a mean, not a median)."""
    ends = [t for t in report["step_end_times"]["0"] if t is not None]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def test_flush_cost_per_step(benchmark, tmp_path):
    if benchmark.disabled:
        pytest.skip("runs under `make bench` only (tests/test_floor.py covers the floor's paths)")
    default = FloorConfig(directory=tmp_path)
    cadences = {"none": (), "every step": ("--durable-every", "1", "--durable-interval", "0"),
                f"default (every {default.every_steps} steps, {default.interval.total_seconds():g} s)": ()}
    runs: dict[str, list[float]] = {name: [] for name in cadences}

    def one_round() -> None:
        for i, (name, options) in enumerate(cadences.items()):
            folder = tmp_path / f"r{len(runs[name])}-{i}"
            folder.mkdir()
            floor = ("--durable", str(folder / "floor"), *options) if name != "none" else ()
            code, report, output = launch(folder, *floor, steps=JOB_STEPS)
            assert code == 0, output[-4000:]
            runs[name].append(_mean_step_seconds(report))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    base = statistics.median(runs["none"])
    _results["per_step"] = {name: {"step_s": statistics.median(v), "vs_none": statistics.median(v) / base, "runs": v}
                            for name, v in runs.items()}


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    if request.config.getoption("benchmark_disable") or not _results:
        return
    lines = ["### The durable floor: a rank's part written, against DCP and the disk (medians)\n",
             "| size | floor part | torch DCP save | disk limit (one write, synced) | floor / limit | floor vs DCP |",
             "|---|---|---|---|---|---|"]
    for key, r in sorted(_results.items()):
        if key.startswith("throughput_"):
            lines.append(f"| {r['size_mib']} MiB | {r['floor_part_s']:.3f} s ({r['floor_gib_s']:.2f} GiB/s) | "
                         f"{r['dcp_save_s']:.3f} s ({r['dcp_gib_s']:.2f} GiB/s) | {r['disk_limit_s']:.3f} s "
                         f"({r['disk_gib_s']:.2f} GiB/s) | {r['floor_vs_limit']:.0%} | {r['floor_vs_dcp']:.2f}x |")
    if "per_step" in _results:
        lines += ["", f"### The demo job's step with a floor ({JOB_STEPS} steps; mean step of a run, median of "
                  f"{ROUNDS} runs each)\n", "| cadence | step | vs no floor |", "|---|---|---|"]
        for name, r in _results["per_step"].items():
            lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} ms | {r['vs_none']:.3f} |")
    write_results("floor", {**_results, "machine": machine()}, lines)
