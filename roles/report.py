"""Job reports (``--report``): every rank's per-step losses as exact floats,
every fault and when it fired, the failovers and their timelines, the
membership table; compared exactly by ``replica compare``. The timeline is
also printed as a table and plotted (PNG, with matplotlib when installed)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from replica.roles.rollouts import served_shards

if TYPE_CHECKING:
    from replica.roles.coordinator import Coordinator, Failover

__all__ = ["PHASES", "build_report", "compare_reports", "load_report", "print_timeline", "write_timeline_png"]

logger = logging.getLogger(__name__)

PHASES = ("detect", "promote", "reconnect", "resumed")  # timeline marks, in ms after the kill


def build_report(coord: Coordinator, *, steps: int, faults: list[str], failure: str | None) -> dict:
    losses, times, metrics = {}, {}, {}
    for rank in range(coord.world_size):
        keys = [f"replica/loss/{rank}/{s}" for s in range(1, steps + 1)]
        logged = [coord.store.get(k).decode().split(" ") if coord.store.check([k]) else [None, None] for k in keys]
        losses[str(rank)] = [parts[0] for parts in logged]
        times[str(rank)] = [float(parts[1]) if parts[1] is not None else None for parts in logged]
        metrics[str(rank)] = [dict(p.split("=", 1) for p in parts[2:]) for parts in logged]
    return {
        "steps": steps,
        "trainers": coord.world_size,
        "failure": failure,
        "losses_hex": losses,
        "metrics_hex": metrics,
        "step_end_times": times,
        "faults": [{"fault": f, "fired_at": coord.fired(f)} for f in faults],
        "failovers": [asdict(f) for f in coord.failovers],
        "standbys_replaced": coord.standbys_replaced,
        "unprotected": sorted(coord.unprotected),
        "unprotected_spans": coord.unprotected_spans,
        "rollouts_lost": coord.rollouts_lost,
        "engine_versions": {str(i): _version(coord, i) for i in range(coord.rollouts)},
        "rollout_shards": served_shards(coord.store) if coord.rollouts else [],
        "rollouts_retired": coord.rollouts_retired,
        "refused_joins": coord.refused,
        "members": coord.membership(),
        "last_commit": coord.record.last(),
    }


def _version(coord: Coordinator, index: int) -> int | None:
    """The weight version rollout engine ``index`` served last."""
    key = f"replica/engine/{index}/version"
    return int(coord.store.get(key)) if coord.store.check([key]) else None


def load_report(path: str | Path) -> dict:
    report = json.loads(Path(path).read_text())
    if "losses_hex" not in report:
        raise ValueError(f"{path} is not a replica job report")
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
    for rank, steps in reference.get("metrics_hex", {}).items():
        for step, (a, b) in enumerate(zip(steps, other.get("metrics_hex", {}).get(rank, [])), start=1):
            if a and b and a != b:
                problems.append(f"rank {rank} step {step}: metrics {a} != {b}")
    return problems


def print_timeline(failovers: list[Failover]) -> None:
    if not failovers:
        return
    print("failover timeline (ms after the kill):")
    print("| rank | generation | commit | reason | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    for f in failovers:
        cells = [f"{f.timeline_ms[k]:.0f}" if k in f.timeline_ms else "-" for k in PHASES]
        print(f"| {f.rank} | {f.generation} | {f.commit} | {f.reason} | " + " | ".join(cells) + " |")


def write_timeline_png(failovers: list[Failover], path: Path) -> bool:
    """One horizontal bar per failover, split at each mark; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("replica: matplotlib is not installed (pip install 'replica[plot]'): no timeline PNG")
        return False
    fig, ax = plt.subplots(figsize=(8, 1 + 0.6 * len(failovers)))
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green")
    for row, f in enumerate(failovers):
        start = 0.0
        for phase, color in zip(PHASES, colors):
            if phase not in f.timeline_ms:
                continue
            end = f.timeline_ms[phase]
            ax.barh(row, end - start, left=start, color=color, label=phase if row == 0 else None)
            start = end
    ax.set_yticks(range(len(failovers)), [f"rank {f.rank} (gen {f.generation})" for f in failovers])
    ax.set_xlabel("ms after the kill")
    ax.set_title("replica failover timeline")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
