"""Where and how the benchmarks write their results: bench/results/NAME.json
(the figures) and NAME.md (a short table for humans)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "copy_seconds", "cores_busy", "cores_floor", "machine", "usable_cores", "write_results"]

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict:
    return {"torch": torch.__version__, "cpus": os.cpu_count()}


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def cores_busy(cpu_s: Sequence[float], wall_s: Sequence[float]) -> float:
    """The share of the usable cores transfers kept busy (median over them): each one's CPU
    time (``support.cpu.cpu_since``) over its seconds times the cores."""
    cores = usable_cores()
    return statistics.median(c / (s * cores) for c, s in zip(cpu_s, wall_s, strict=True))


def cores_floor(wall_s: float, cpu_s: float, extra_s: float) -> float:
    """The least time a transfer of ``wall_s`` seconds and ``cpu_s`` CPU seconds takes with
    ``extra_s`` seconds of one core's work added, were that work to use every usable core
    with none idle: a floor from core time alone."""
    return max(wall_s, (cpu_s + extra_s) / usable_cores())


def copy_seconds(dst, src, *, rounds: int = 6) -> float:
    """The median seconds of ``dst.copy_(src)`` between GPU synchronizations, the first
    round left out (a physical limit measured beside a GPU benchmark)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def write_results(name: str, result: dict, markdown: list[str]) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(markdown) + "\n")
