"""The 256-GPU projection of bench/ettr.py (``make ettr``): the model of bench/ettr_model.py
driven by what the run and the control-plane simulator (``make bench-scale``) measured. A
model, not a measurement: every assumption is stated beside the table it writes."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from ettr_model import Projection, project

__all__ = ["measured_control", "measured_detection", "projection"]


def _scale_results(path: Path | None) -> dict:
    path = path or Path(__file__).resolve().parent / "results" / "control_scale.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measured_detection(ranks: int, path: Path | None = None) -> tuple[float, int] | None:
    """The detection time of a lost host (seconds) the control-plane simulator measured with
    the real coordinator at the N nearest ``ranks`` (``make bench-scale``:
    bench/results/control_scale.json), and that N; None before it ran. The runs whose members
    beat to the liveness endpoint (the default) where there are any."""
    runs = [c for c in _scale_results(path).get("coordinator", []) if c.get("detect_lost_host_ms")]
    runs = [c for c in runs if c.get("beats") == "endpoint"] or runs
    if not runs:
        return None
    nearest = min(runs, key=lambda c: abs(c["n"] - ranks))
    return nearest["detect_lost_host_ms"] / 1e3, nearest["n"]


def measured_control(ranks: int, step_s: float, path: Path | None = None) -> tuple[float, int] | None:
    """A trainer's control-plane time per step (seconds) at the N nearest ``ranks`` the simulator
    ran on the TCPStore: its own requests, plus any part of the commit's latency longer than
    ``step_s`` (it waits for that at its next commit); and that N. None before it ran."""
    runs = [r for r in _scale_results(path).get("runs", []) if r.get("store") == "tcp" and "trainer_ms_median" in r]
    if not runs:
        return None
    nearest = min(runs, key=lambda r: abs(r["n"] - ranks))
    late = max(0.0, nearest["commit_ms_median"] / 1e3 - step_s)
    return nearest["trainer_ms_median"] / 1e3 + late, nearest["n"]


def projection(result: dict) -> tuple[dict, list[str]]:
    """The 256-GPU model, with this run's measured restart share where it has one, and the
    detection time the control-plane simulator measured at that scale where it ran."""
    timelines = [
        f["timeline_ms"]
        for runs in result["runs"].values()
        for report in runs.get("replica", {}).get("reports", [])
        for f in report["failovers"]
    ]
    measured = {}
    if timelines:  # promotion and reconnection as measured in this run's failovers (medians)
        measured = {
            "promote_s": statistics.median(t["promote"] for t in timelines) / 1e3,
            "reconnect_s": statistics.median(t["resumed"] - t["promote"] for t in timelines) / 1e3,
        }
    ranks = Projection().trainer_hosts * Projection().gpus_per_host
    scale = measured_detection(ranks)
    if scale is not None:
        measured["detect_s"] = scale[0]
    control = measured_control(ranks, Projection().step_s)
    if control is not None:
        measured["control_s"] = control[0]
    model = replace(Projection(), wait_for_standby=not result["train_while_replacing"], **measured)
    mtbfs = [3600 * h for h in (4, 1, 0.5, 0.25)]
    rows = project(model, mtbfs)
    source = "medians of this run's failovers" if measured else "measured across hosts"
    lines = [
        "\n**Projection to 256 GPUs: a model, not a measurement.** 32 trainer hosts x 8 GPUs, a 32B dense "
        f"policy ({model.state_gb:.0f} GB of training state, {model.per_host_gb():.0f} GB per host), a "
        f"{model.step_s:g} s RL step; replica per failure: detection {model.detect_s:.2f} s ("
        + (
            f"a lost host's detection by the real coordinator with {scale[1]} simulated ranks, make bench-scale"
            if scale is not None
            else "the heartbeat deadline: a lost host"
        )
        + "), promotion {model.promote_s:.2f} s and reconnection {model.reconnect_s:.1f} s "
        f"({source}), half a "
        f"step redone"
        + (
            f", a new standby's start ({model.standby_start_s:g} s, assumed) and resync at {model.link_gb_s:g} GB/s"
            if model.wait_for_standby
            else " (training goes on while the new standby starts)"
        )
        + (
            f"; the control plane's time on a trainer's step {model.control_s * 1e3:.2f} ms (the simulator's, "
            f"{control[1]} ranks on a TCPStore)"
            if control is not None
            else ""
        )
        + f"; checkpoint-restart: saves and loads at {model.storage_gb_s:g} GB/s "
        f"aggregate, a restart of {model.restart_fixed_s:g} s plus the load (assumed), at its best interval.\n",
        f"Correlated failures in the mix: {model.pair_fraction:.1%} of the failures lose a trainer host with the "
        "host of its standbys (Llama 3 405B's breakdown: network switch/cable, 8.4% of 419 interruptions, the "
        "one cause there that takes several hosts; counted fatal, as if domains were single hosts under one "
        "switch; the rest, host maintenance 7.6% included, take one host). With the floor such a loss costs a "
        f"restart of every role ({model.restart_fixed_s:g} s, as checkpoint-restart's), the version's load and "
        f"half the floor's cadence ({model.floor_every_s:g} s) replayed"
        + (f", and the floor costs {model.floor_overhead:.2%} of every step (measured)" if model.floor_overhead else "")
        + "; without it the job restarts from the user's own checkpoints (checkpoint-restart at its "
        "best interval for the pair losses' rate). With failure domains at the switch (each trainer host's "
        "standbys under another switch: `--domain`, `REPLICA_DOMAIN`), a switch's loss is ordinary failovers; "
        "a pair is lost only by chance, a second failure on the partner host inside the first one's "
        f"unprotected span ({model.unprotected_s():.0f} s: a new standby's start and resync), counted in both "
        "columns.\n",
        f"A trainer's failure redoes only the training part in flight ({1 - model.rollout_share:.0%} of a step, "
        "assumed): the step's request is kept and the engines generate on through the failover "
        "(roles/rollouts.py); the column before it redid half a step.\n",
        "| job MTBF | MTBF (steps) | replica | replica, switch domains | single failures only | rollouts redone "
        "| replica without the floor | checkpoint-restart (K) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mtbf_s'] / 3600:g} h | {row['mtbf_steps']:.1f} | {row['replica']:.3f} | "
            f"{row['replica_switch_domains']:.3f} | {row['replica_single_failures']:.3f} | "
            f"{row['replica_rollouts_redone']:.3f} | "
            f"{row['replica_without_floor']:.3f} | {row['checkpoint_restart']:.3f} ({row['checkpoint_every']}) |"
        )
    lines.append(
        "\nPublished, for comparison (their injection models are not published): RobustRL > 0.80 at its "
        '"10% failure injection frequency" on 256 GPUs, ByteRobust\'s restart-based recovery 0.60 there; '
        "ByteRobust 0.97 over three months on 9,600 GPUs."
    )
    return {"assumptions": asdict(model), "rows": rows}, lines
