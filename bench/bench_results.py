"""Where and how the benchmarks write their results: bench/results/NAME.json
(the figures) and NAME.md (a short table for humans)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "machine", "write_results"]

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict:
    return {"torch": torch.__version__, "cpus": os.cpu_count()}


def write_results(name: str, result: dict, markdown: list[str]) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(markdown) + "\n")
