"""Job reports (``replica launch --report``): compare two runs' per-step losses exactly."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["compare_reports", "load_report"]


def load_report(path: str | Path) -> dict:
    report = json.loads(Path(path).read_text())
    if "losses_hex" not in report:
        raise ValueError(f"{path} is not a replica launch report")
    return report


def compare_reports(reference: dict, other: dict) -> list[str]:
    """Every difference in the per-rank, per-step losses (compared as exact floats)."""
    problems = []
    if reference["trainers"] != other["trainers"] or reference["steps"] != other["steps"]:
        return [f"different jobs: {reference['trainers']} trainers x {reference['steps']} steps against "
                f"{other['trainers']} x {other['steps']}"]
    for rank, losses in reference["losses_hex"].items():
        for step, (a, b) in enumerate(zip(losses, other["losses_hex"][rank]), start=1):
            if a is None or b is None:
                problems.append(f"rank {rank} step {step}: no loss recorded ({a} / {b})")
            elif float.fromhex(a) != float.fromhex(b):
                problems.append(f"rank {rank} step {step}: {float.fromhex(a)!r} != {float.fromhex(b)!r}")
    return problems
