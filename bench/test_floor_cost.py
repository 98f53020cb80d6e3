"""The durable floor's cost (issue 56).

* ``test_flush_throughput``: one rank's part written as a standby writes it (``write_export``
  and an fsync of the file and its folder) against ``torch.distributed.checkpoint.save`` of the
  same tensors from one process (what a trainer's DCP checkpoint writes) and against the
  disk's limit measured in the same run (the same bytes in one sequential write); all three as
  durable (the files and their folder synced), in turn within each round. Medians of ROUNDS;
  ratios to the limit. ``make test`` runs it at a small size as a check that the paths work;
  ``make bench`` at SIZE_MIB.
* ``test_flush_cost_per_step`` (``make bench``): a mirrored 2-rank job, its standbys on cores
  of their own as on a rollout machine (bench/mirror_jobs.py), in turns of blocks of steps
  without a floor, with a version every step (the worst cadence) and at the default cadence;
  a version's cost on the steps (every-step blocks paired with the blocks before them) and
  that cost spread over the default cadence's steps (the target: <= 1% a step).

Writes bench/results/floor.{json,md}."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from bench_results import machine, write_results
from fsdp_job import JobShape
from mirror_jobs import pinned_job

from replica.mirror.floor import FloorConfig, write_part
from replica.state.layout import StateLayout
from replica.state.snapshot import Snapshot

ROUNDS = 5
SIZE_MIB = 512  # make bench: a rank's part of a ~40M-parameter model with AdamW (16 bytes a parameter)
SMOKE_MIB = 16  # make test
TENSORS = 64
# Much state for little compute: a flush takes about as long as a step, so the every-step cadence
# has one always in flight.
COST_SHAPE = JobShape(dim=512, layers=2, seq=16, batch=2, samples=8192, total_steps=100_000)
COST_WARMUP = 5
COST_BLOCK_STEPS, COST_ROUNDS = 16, 15  # per cadence
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

    medians = _median_seconds(
        {"limit": lambda i: _raw_write(tmp_path / f"raw{i}" / "part", raw), "floor": floor_part, "dcp": dcp_save},
        rounds,
    )
    limit, ours, theirs = medians["limit"], medians["floor"], medians["dcp"]
    assert (tmp_path / "floor0" / "rank00000.safetensors").stat().st_size >= nbytes * 0.99
    gib = nbytes / (1 << 30)
    row = {
        "size_mib": size_mib,
        "rounds": rounds,
        "floor_part_s": ours,
        "dcp_save_s": theirs,
        "disk_limit_s": limit,
        "floor_gib_s": gib / ours,
        "dcp_gib_s": gib / theirs,
        "disk_gib_s": gib / limit,
        "floor_vs_limit": limit / ours,
        "floor_vs_dcp": theirs / ours,
    }
    print(
        f"flush of {size_mib} MiB: floor part {ours:.3f} s ({row['floor_gib_s']:.2f} GiB/s), DCP save "
        f"{theirs:.3f} s ({row['dcp_gib_s']:.2f} GiB/s), the disk's limit {limit:.3f} s ({row['disk_gib_s']:.2f} "
        f"GiB/s): {row['floor_vs_limit']:.0%} of the limit, {row['floor_vs_dcp']:.2f}x DCP"
    )
    if not benchmark.disabled:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures are the medians above
        _results[f"throughput_{size_mib}"] = row


def _block(job, cadence: tuple[int, float] | None, folder: Path, steps: int) -> dict:
    """``steps`` steps of ``job`` with its standbys' floors at ``cadence`` (every_steps,
    interval_s; None: no floor), its first step not counted (the floor starts during it): the
    step times, rank 0's mirror stream times, and the versions each standby wrote."""
    if cadence is not None:
        for s in job.standbys:
            s.send("floor_on", str(folder), *cadence)
        assert all(s.recv(60) == ("floor",) for s in job.standbys)
    streams_before = len(job.stats()["stream_s"])
    took = [job.run_step() for _ in range(steps)][1:]
    stream_s = job.stats()["stream_s"][streams_before + 1 :]
    written = []
    if cadence is not None:
        for s in job.standbys:
            s.send("floor_off")
        for s in job.standbys:
            _, parts, errors, seconds = s.recv(120)
            assert errors == 0, f"the floor failed to write {errors} time(s) in {folder}"
            written.append((parts, seconds))
    return {"step_s": took, "stream_s": stream_s, "written": written}


def test_flush_cost_per_step(benchmark, tmp_path):
    """The mirrored job (bench/mirror_jobs.py: standbys on cores of their own, as on a rollout
    machine) in turns of blocks of steps without a floor, with a version every step (the worst
    cadence: a flush always in flight) and at the default cadence; the drift of a shared machine
    falls on all three alike. A flush's cost on the steps: the every-step blocks' extra time
    over the blocks without, per version written; the default cadence's cost per step is that
    cost once every ``every_steps`` steps (its own blocks write a version only when they hold
    such a step: they show it is no worse than the every-step figure, not its size)."""
    if benchmark.disabled:
        pytest.skip("runs under `make bench` only (tests/test_floor.py covers the floor's paths)")
    default = FloorConfig(directory=tmp_path)
    cadences = {
        "none": None,
        "every step": (1, 0.0),
        "default": (default.every_steps, default.interval.total_seconds()),
    }
    blocks: dict[str, list[dict]] = {name: [] for name in cadences}
    with contextlib.ExitStack() as stack:
        job = stack.enter_context(pinned_job(stack, "floor", 2, COST_SHAPE, {"bucket_bytes": 1 << 20}))
        for _ in range(COST_WARMUP):
            job.run_step()
        nbytes = job.stats()["snapshot_bytes"]

        order = list(cadences)

        def one_round() -> None:
            # The order turns each round: whatever a block leaves behind (the kernel's writeback of
            # the files it deleted) falls on each cadence's blocks alike.
            for name in order:
                blocks[name].append(_block(job, cadences[name], tmp_path / name.replace(" ", "-"), COST_BLOCK_STEPS))
                os.sync()
            order.append(order.pop(0))

        benchmark.pedantic(one_round, rounds=COST_ROUNDS, iterations=1)
    step = {name: statistics.median([t for b in bs for t in b["step_s"]]) for name, bs in blocks.items()}
    mean = {name: statistics.fmean([t for b in bs for t in b["step_s"]]) for name, bs in blocks.items()}
    stream = {name: statistics.median([t for b in bs for t in b["stream_s"]]) for name, bs in blocks.items()}
    versions = statistics.fmean([min(p for p, _ in b["written"]) for b in blocks["every step"]])  # a block's
    flush_s = statistics.fmean([s / p for b in blocks["every step"] for p, s in b["written"] if p])  # a part's write
    assert versions > 0, "no version was written at the every-step cadence"
    counted = COST_BLOCK_STEPS - 1
    # Paired by round: each every-step block against the same round's block without a floor.
    extra = statistics.median(
        [sum(e["step_s"]) - sum(n["step_s"]) for e, n in zip(blocks["every step"], blocks["none"], strict=True)]
    )
    # The same pairing of two blocks that differ only by the noise: the default's (a version in one
    # block of about ``every_steps / COST_BLOCK_STEPS``) against the no-floor ones.
    noise = statistics.median(
        [abs(sum(d["step_s"]) - sum(n["step_s"])) for d, n in zip(blocks["default"], blocks["none"], strict=True)]
    )
    per_version = extra / versions
    default_cost = per_version / default.every_steps / mean["none"]
    _results["per_step"] = {
        "snapshot_bytes_per_rank": nbytes,
        "block_steps": COST_BLOCK_STEPS,
        "rounds": COST_ROUNDS,
        "step_ms_median": {n: v * 1e3 for n, v in step.items()},
        "step_ms_mean": {n: v * 1e3 for n, v in mean.items()},
        "stream_ms_median": {n: v * 1e3 for n, v in stream.items()},
        "versions_per_block_every_step": versions,
        "part_write_ms": flush_s * 1e3,
        "counted_steps_per_block": counted,
        "extra_ms_per_version": per_version * 1e3,
        "paired_noise_ms_per_block": noise * 1e3,
        "paired_extra_ms_per_block": extra * 1e3,
        "every_step_vs_none": mean["every step"] / mean["none"],
        "default_vs_none_measured": mean["default"] / mean["none"],
        "default_cost_per_step": default_cost,
        "default_every_steps": default.every_steps,
    }
    r = _results["per_step"]
    print(
        f"floor cost: step {r['step_ms_mean']}, a version costs the steps {r['extra_ms_per_version']:.2f} ms; "
        f"every step x{r['every_step_vs_none']:.3f}, default (every {default.every_steps}) "
        f"{default_cost:.3%} a step"
    )


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    if request.config.getoption("benchmark_disable") or not _results:
        return
    lines = [
        "### The durable floor: a rank's part written, against DCP and the disk (medians)\n",
        "| size | floor part | torch DCP save | disk limit (one write, synced) | floor / limit | floor vs DCP |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in sorted(_results.items()):
        if key.startswith("throughput_"):
            lines.append(
                f"| {r['size_mib']} MiB | {r['floor_part_s']:.3f} s ({r['floor_gib_s']:.2f} GiB/s) | "
                f"{r['dcp_save_s']:.3f} s ({r['dcp_gib_s']:.2f} GiB/s) | {r['disk_limit_s']:.3f} s "
                f"({r['disk_gib_s']:.2f} GiB/s) | {r['floor_vs_limit']:.0%} | {r['floor_vs_dcp']:.2f}x |"
            )
    if "per_step" in _results:
        r = _results["per_step"]
        mib = r["snapshot_bytes_per_rank"] / (1 << 20)
        lines += [
            "",
            f"### The mirrored job's step with a floor (2 ranks, {mib:.1f} MiB a rank; standbys on cores "
            f"of their own; {r['rounds']} rounds of {r['block_steps']}-step blocks in turn)\n",
            "| cadence | step, mean | step, median | mirror stream, median | vs no floor (means) |",
            "|---|---|---|---|---|",
        ]
        for name in r["step_ms_mean"]:
            lines.append(
                f"| {name} | {r['step_ms_mean'][name]:.2f} ms | {r['step_ms_median'][name]:.2f} ms | "
                f"{r['stream_ms_median'][name]:.2f} ms | "
                f"{r['step_ms_mean'][name] / r['step_ms_mean']['none']:.3f} |"
            )
        lines += [
            "",
            f"A version costs the steps {r['extra_ms_per_version']:.2f} ms (every-step blocks against the "
            f"same round's blocks without a floor, {r['versions_per_block_every_step']:.1f} versions a block, "
            f"a part written in {r['part_write_ms']:.0f} ms); at the default "
            f"cadence (every {r['default_every_steps']} steps) that is **{r['default_cost_per_step']:.3%} of a "
            "step** (target <= 1%). Paired by round, an every-step block took "
            f"{r['paired_extra_ms_per_block']:.0f} ms longer than the block without a floor; a default-cadence "
            f"block and a block without a floor differed by {r['paired_noise_ms_per_block']:.0f} ms (median of "
            "the absolute differences: the noise).",
        ]
    write_results("floor", {**_results, "machine": machine()}, lines)
