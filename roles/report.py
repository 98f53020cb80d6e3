"""Job reports (``--report``): every rank's per-step losses as exact floats,
every fault and when it fired, the failovers and their timelines, the
membership table; compared exactly by ``replica compare``. The timeline is
also printed as a table and plotted (PNG, with matplotlib when installed), and
``replica compare --plot`` draws two runs' loss curves with their faults marked."""

from __future__ import annotations

import collections
import json
import logging
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from replica.jobstore import JobStore, keys
from replica.roles.env import Action, parse_faults
from replica.roles.members import Mark
from replica.roles.rollouts import regenerated_tokens, reopened_tokens, served_shards
from replica.state.divergence import Divergence, Measure

if TYPE_CHECKING:
    from replica.roles.coordinator import Coordinator
    from replica.roles.members import FailoverTimeline

__all__ = [
    "PHASES",
    "build_report",
    "compare_reports",
    "fill_from",
    "load_report",
    "logged",
    "print_timeline",
    "summary_lines",
    "write_loss_png",
    "write_timeline_png",
]

logger = logging.getLogger(__name__)

PHASES = tuple(Mark)  # a failover's timeline marks, in order (ms after the kill)


def logged(store: JobStore, *, world_size: int, steps: int, faults: list[str]) -> dict:
    """What the roles of an attempt recorded in its store (``store``, at the attempt's prefix): the
    report's per-rank losses, divergences, metrics and step end times, and when each of ``faults``
    fired (None: not in this attempt)."""
    losses, times, metrics, divergences = {}, {}, {}, []
    for rank in range(world_size):
        found = store.get_many([keys.divergence(rank, s, m.value) for s in range(1, steps + 1) for m in Measure])
        divergences += [Divergence.from_json(t.value).to_dict() for t in found if t is not None]
        texts = store.get_many([keys.loss(rank, s) for s in range(1, steps + 1)])
        lines = [t.value.split(" ") if t is not None else [] for t in texts]  # []: the step was not logged
        losses[str(rank)] = [parts[0] if parts else None for parts in lines]
        times[str(rank)] = [float(parts[1]) if parts else None for parts in lines]
        metrics[str(rank)] = [dict(p.split("=", 1) for p in parts[2:]) for parts in lines]
    stamps = store.get_many([keys.killed(f) for f in faults])
    return {
        "losses_hex": losses,
        # Steps redone after a failover that did not reproduce their loss or state (the
        # divergence guard); "comparable": false where the computation is not deterministic.
        "divergences": divergences,
        "metrics_hex": metrics,
        "step_end_times": times,
        "faults": [
            {"fault": f, "fired_at": None if stamp is None else stamp.at}
            for f, stamp in zip(faults, stamps, strict=False)
        ],
    }


def build_report(coord: Coordinator, *, steps: int, faults: list[str], failure: str | None) -> dict:
    recorded = logged(coord.store, world_size=coord.world_size, steps=steps, faults=faults)
    return {
        "steps": steps,
        "trainers": coord.world_size,
        "failure": failure,
        **recorded,
        "failovers": [asdict(f) for f in coord.failovers],
        "regroups": coord.regroups,
        "standbys_replaced": coord.standbys_replaced,
        "unprotected": sorted(coord.unprotected),
        "unprotected_spans": coord.unprotected_spans,
        "rollouts_lost": coord.rollouts_lost,
        "late_exits": coord.late_exits,
        # Members silent past their deadline judged stalled, not dead (their process ran, or many
        # were silent together): when, why, and how it ended (recovered, dead, left).
        "suspected_stalls": [{k: v for k, v in s.items() if k != "looked"} for s in coord.suspected_stalls],
        # The coordinator's own stalls (gaps between its polls), whose span counted against no member.
        "coordinator_stalls": coord.stalls.summary(),
        "engine_versions": {str(i): _version(coord, i) for i in range(coord.rollouts)},
        "rollout_shards": (shards := served_shards(coord.store) if coord.rollouts else []),
        # Tokens of a step's shard generated once more (a redone step asking again; target 0 when the
        # rollouts were done before a trainer died: they are kept). An engine's lost shard is not in
        # here: it wrote no result.
        "rollout_tokens_regenerated": regenerated_tokens(shards) + reopened_tokens(coord.store),
        "rollouts_retired": coord.rollouts_retired,
        "rollout_split": _rollout_split(coord, steps, recorded["step_end_times"].get("0", []))
        if coord.rollouts
        else None,
        "refused_joins": coord.refused,
        "members": coord.membership(),
        "last_commit": coord.record.last(),
        # The coordinator's liveness endpoint: the beats (UDP datagrams) it took, the forged or
        # malformed ones it dropped, and how many of the members not declared dead it heard (the others
        # beat to the store).
        "liveness": coord.liveness_report(),
        "takeover": coord.takeover,  # this coordinator took over from a dead one (None: it ran the whole job)
        "floor": _floor(coord, steps),
    }


def _floor(coord: Coordinator, steps: int) -> dict:
    """The durable floor (--durable): the complete versions it ever had (their manifests), the
    newest, and how many parts could not be written."""
    found = coord.store.get_many([keys.floor_version(s) for s in range(1, steps + 1)])
    latest = coord.store.get(keys.floor_latest())
    return {
        "versions": [v.step for v in found if v is not None],
        "latest": None if latest is None else latest.value,
        "errors": coord.store.count(keys.floor_errors()),
    }


def _rollout_split(coord: Coordinator, steps: int, ends: list[float | None]) -> dict | None:
    """How much of a step the rollouts took: the leader's seconds in each step's push and generate
    beside the step's own (rank 0's step end times, from the second step: the first has no start)."""
    found = coord.store.get_many([keys.rollout_seconds(s) for s in range(1, steps + 1)])
    rollout, step = [], []
    for s in range(2, min(steps, len(ends)) + 1):
        took, before, end = found[s - 1], ends[s - 2], ends[s - 1]
        if took is not None and before is not None and end is not None and end > before:
            rollout.append(float(took.value))
            step.append(end - before)
    if not step:
        return None
    return {
        "steps_measured": len(step),
        "rollout_s_median": statistics.median(rollout),
        "step_s_median": statistics.median(step),
        "rollout_share_median": statistics.median(r / t for r, t in zip(rollout, step, strict=False)),
    }


def fill_from(report: dict, earlier: dict) -> None:
    """Steps ``report``'s attempt did not run (it resumed from a version of the job's durable floor)
    take what ``earlier`` (an attempt before it) recorded: losses, metrics, step end times."""
    have = {f["fault"] for f in report.get("faults", [])}
    report["faults"] = [
        f for f in earlier.get("faults", []) if f["fault"] not in have and f.get("fired_at")
    ] + report.get("faults", [])  # the faults that fired before (not injected again) stay on record
    for field in ("losses_hex", "metrics_hex", "step_end_times"):
        for rank, values in report.get(field, {}).items():
            before = earlier.get(field, {}).get(rank, [])
            for i, value in enumerate(values):
                if value in (None, {}) and i < len(before) and before[i] not in (None, {}):
                    values[i] = before[i]


def _version(coord: Coordinator, index: int) -> int | None:
    """The weight version rollout engine ``index`` served last."""
    version = coord.store.get(keys.engine_version(index))
    return None if version is None else version.value


def load_report(path: str | Path) -> dict:
    """A job report (``--report``); ValueError when the file is not one."""
    try:
        report = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a replica job report (not JSON: {exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("losses_hex"), dict) or "steps" not in report:
        raise ValueError(f"{path} is not a replica job report (no per-rank losses)")
    return report


def compare_reports(reference: dict, other: dict) -> list[str]:
    """Every difference in the per-rank, per-step losses (compared as exact floats)."""
    problems = []
    if reference["trainers"] != other["trainers"] or reference["steps"] != other["steps"]:
        return [
            f"different jobs: {reference['trainers']} trainers x {reference['steps']} steps against "
            f"{other['trainers']} x {other['steps']}"
        ]
    for rank, losses in reference["losses_hex"].items():
        for step, (a, b) in enumerate(zip(losses, other["losses_hex"][rank], strict=False), start=1):
            if a is None or b is None:
                problems.append(f"rank {rank} step {step}: no loss recorded ({a} / {b})")
            elif float.fromhex(a) != float.fromhex(b):
                problems.append(f"rank {rank} step {step}: {float.fromhex(a)!r} != {float.fromhex(b)!r}")
    for rank, steps in reference.get("metrics_hex", {}).items():
        for step, (a, b) in enumerate(zip(steps, other.get("metrics_hex", {}).get(rank, []), strict=False), start=1):
            if a and b and a != b:
                problems.append(f"rank {rank} step {step}: metrics {a} != {b}")
    for which, report in (("reference", reference), ("run", other)):
        for found in report.get("divergences", []):
            problems.append(
                f"{which}: the divergence guard found: {Divergence.from_json(json.dumps(found)).describe()}"
            )
    return problems


def summary_lines(report: dict) -> list[str]:
    """What happened in a run, in a few lines for the end of `replica launch` (the report holds
    the details): failovers, divergences, suspected stalls, unprotected spans, the coordinator's
    own stalls."""
    failovers = report["failovers"]
    lines = [
        f"{report['steps']} steps, last commit {report['last_commit']}"
        + (f"; {report['failure']}" if report["failure"] else "")
    ]  # supervise's "the job failed: ..."
    lines.append(
        f"failovers: {len(failovers)}"
        + (
            " (" + ", ".join(f"rank {f['rank']} from commit {f['commit']}" for f in failovers) + ")"
            if failovers
            else ""
        )
    )
    divergences = report["divergences"]
    lines.append(
        f"divergences after a failover: {len(divergences)}"
        + (
            " (" + ", ".join(f"rank {d.get('rank')} step {d.get('step')}" for d in divergences) + "; see the report)"
            if divergences
            else ""
        )
    )
    stalls = report.get("suspected_stalls", [])
    outcomes = collections.Counter(s["outcome"] or "open" for s in stalls)
    lines.append(
        f"suspected stalls: {len(stalls)}"
        + (" (" + ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())) + ")" if stalls else "")
    )
    spans = report["unprotected_spans"]
    lines.append(
        f"unprotected spans: {len(spans)}"
        + (
            " ("
            + ", ".join(
                f"rank {s['rank']} from commit {s['from_commit']} to "
                f"{'the end' if s['until_commit'] is None else s['until_commit']}"
                for s in spans
            )
            + ")"
            if spans
            else ""
        )
    )
    resumed = [r for r in report.get("restarts", []) if "resumed_from_floor" in r]
    if resumed:
        lines.append(
            "resumed from the durable floor: "
            + ", ".join(
                f"version {r['resumed_from_floor']} (commit {r['lost_commit']} lost: "
                f"{r['lost_commit'] - r['resumed_from_floor']} steps replayed)"
                for r in resumed
            )
        )
    split = report.get("rollout_split")
    if split:
        lines.append(
            f"rollouts: {100 * split['rollout_share_median']:.0f}% of a step (median of "
            f"{split['steps_measured']} steps: push and generate {split['rollout_s_median']:.2f} s, "
            f"the step {split['step_s_median']:.2f} s)"
        )
    own = report.get("coordinator_stalls", {})
    if own.get("count"):
        lines.append(
            f"coordinator stalls: {own['count']} ({own['total_s']:.1f} s in all, the longest "
            f"{own['longest_s']:.1f} s; they counted against no member)"
        )
    return [f"replica: {line}" for line in lines]


def print_timeline(failovers: list[FailoverTimeline]) -> None:
    if not failovers:
        return
    print("failover timeline (ms after the kill):")
    print("| rank | generation | commit | reason | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    for f in failovers:
        cells = [f"{f.timeline_ms[k]:.0f}" if k in f.timeline_ms else "-" for k in PHASES]
        print(f"| {f.rank} | {f.generation} | {f.commit} | {f.reason} | " + " | ".join(cells) + " |")


def _pyplot(what: str):
    """matplotlib.pyplot drawing to files, or None (said once) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"replica: matplotlib is not installed (pip install 'replica[plot]'): no {what} PNG")
        return None
    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_timeline_png(failovers: list[FailoverTimeline], path: Path) -> bool:
    """One horizontal bar per failover, split at each mark; False without matplotlib."""
    plt = _pyplot("timeline")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 1 + 0.6 * len(failovers)))
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green")
    for row, f in enumerate(failovers):
        start = 0.0
        for phase, color in zip(PHASES, colors, strict=False):
            if phase not in f.timeline_ms:
                continue
            end = f.timeline_ms[phase]
            ax.barh(row, end - start, left=start, color=color, label=phase if row == 0 else None)
            start = end
    ax.set_yticks(range(len(failovers)), [f"rank {f.rank} (gen {f.generation})" for f in failovers])
    ax.set_xlabel("ms after the kill")
    ax.set_title("replica failover timeline")
    ax.legend(loc="lower right", fontsize="small")
    _save(plt, fig, path)
    return True


def _curve(values: list, convert=float.fromhex) -> list[float]:
    return [float("nan") if v is None else convert(v) for v in values]


def write_loss_png(reference: dict, other: dict, path: Path, *, names: tuple[str, str] = ("reference", "run")) -> bool:
    """Both runs' per-step loss of every rank (top) and seconds per step of rank 0
    (bottom), with the other run's faults marked at the step they fired in; False
    without matplotlib."""
    plt = _pyplot("loss")
    if plt is None:
        return False
    fig, (loss_ax, time_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
    for (rank, ref), color in zip(
        sorted(reference["losses_hex"].items(), key=lambda kv: int(kv[0])),
        ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"),
        strict=False,
    ):
        steps = range(1, len(ref) + 1)
        # The curves coincide when the runs are equal: the reference wide and pale, the other thin on top.
        loss_ax.plot(steps, _curve(ref), color=color, linewidth=5, alpha=0.3, label=f"rank {rank}, {names[0]}")
        loss_ax.plot(
            steps,
            _curve(other["losses_hex"].get(rank, [])),
            color=color,
            linewidth=1,
            marker=".",
            markersize=4,
            label=f"rank {rank}, {names[1]}",
        )
    for report, name, style in (
        (reference, names[0], dict(linewidth=5, alpha=0.3, color="gray")),
        (other, names[1], dict(linewidth=1, marker=".", markersize=4, color="black")),
    ):
        ends = _curve(report.get("step_end_times", {}).get("0", []), convert=float)
        if len(ends) > 1:
            time_ax.plot(
                range(2, len(ends) + 1), [b - a for a, b in zip(ends, ends[1:], strict=False)], label=name, **style
            )
    for fault in other.get("faults", []):
        if not fault.get("fired_at"):
            continue
        (parsed,) = parse_faults(fault["fault"])
        color = "tab:red" if parsed.action == Action.KILL else "tab:orange"
        loss_ax.axvline(parsed.step, color=color, linestyle="--", linewidth=1, label=f"{fault['fault']} fired")
        time_ax.axvline(parsed.step, color=color, linestyle="--", linewidth=1)
    for failover in other.get("failovers", []):
        loss_ax.axvline(
            failover["commit"],
            color="gray",
            linestyle=":",
            linewidth=1,
            label=f"rank {failover['rank']} failed over to commit {failover['commit']}",
        )
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(f"replica: per-step loss, {names[0]} and {names[1]}")
    loss_ax.legend(loc="best", fontsize="small", ncol=2)
    time_ax.set_ylabel("s per step (rank 0)")
    time_ax.set_xlabel("step")
    time_ax.legend(loc="upper right", fontsize="small")
    _save(plt, fig, path)
    return True
