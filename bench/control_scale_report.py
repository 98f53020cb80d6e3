"""The control-plane simulation's report (``bench/control_scale.py``): the Markdown table,
the plot of latency against N, the fitted exponent of growth, and a run merged into the
results already on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["exponent", "merged", "plot", "report"]


def exponent(points: list[tuple[int, float]]) -> float | None:
    """The slope of log(work) against log(N): 1 for linear growth, 2 for quadratic."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(n) for n, _ in points], [math.log(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sum((x - mx) ** 2 for x in xs)


def report(results: list[dict], out: Path, coordinators: list[dict] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for kind in sorted({r["store"] for r in results}):
        mine = sorted((r for r in results if r["store"] == kind), key=lambda r: r["n"])
        summary[kind] = {
            "requests_exponent": exponent([(r["n"], r["requests_per_step"]) for r in mine]),
            "bytes_exponent": exponent([(r["n"], r["bytes_per_step"]) for r in mine]),
        }
    (out / "control_scale.json").write_text(
        json.dumps({"runs": results, "fit": summary, "coordinator": list(coordinators)}, indent=1)
    )
    lines = [
        "### Control plane at scale, simulated ranks on this machine (`make bench-scale`)\n",
        "| store | N ranks | commit after the last ack, median / p99 | store requests per step (per rank) | "
        "bytes per step | largest read (keys) | beats to the store: writes/s done / asked | the coordinator's "
        "scan of them (its CPU per s) | beats to the liveness endpoint: taken/s / asked, store writes | "
        "the endpoint's CPU per s, scan of its table |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['store']} | {r['n']} | {r['commit_ms_median']:.1f} / {r['commit_ms_p99']:.1f} ms | "
            f"{r['requests_per_step']:.0f} ({r['requests_per_rank_step']:.2f}) | "
            f"{r['bytes_per_step'] / 1e3:.0f} kB | {r['largest_read_keys']} | "
            f"{r['heartbeat_writes_per_s']:.0f} / {r['heartbeat_writes_asked_per_s']:.0f} | "
            f"{r['scan_ms_median']:.1f} ms ({r['scan_cpu_per_s']:.2f} s) | "
            f"{r['endpoint_datagrams_per_s']:.0f} / {r['native_asked_per_s']:.0f}, "
            f"{r['native_store_writes']} | {r['endpoint_cpu_per_s']:.2f} s, "
            f"{r['endpoint_scan_ms_median']:.2f} ms |"
        )
    for kind in sorted({r["store"] for r in results}):
        mine = sorted((r for r in results if r["store"] == kind), key=lambda r: r["n"])
        fits = [r["n"] for r in mine if r["overhead_1s_pct"] < 1.0]
        lines.append(
            f"\n{kind}: a trainer's control-plane time per step "
            + ", ".join(
                f"{r['trainer_ms_median']:.2f} ms at N = {r['n']} ({r['overhead_1s_pct']:.2f}% of a 1 s step)"
                for r in mine
            )
            + f"; the largest N run under 1%: {max(fits) if fits else 'none'}."
        )
    for kind, fit in summary.items():
        if fit["requests_exponent"] is not None:
            lines.append(
                f"\n{kind}: per-step work grows as N^{fit['requests_exponent']:.2f} (requests) and "
                f"N^{fit['bytes_exponent']:.2f} (bytes)."
            )
    if coordinators:
        lines += [
            "",
            "| the real coordinator, N ranks (2N members) | store | beats to | join of every member | its "
            "CPU per s | a poll, median / p99 | false deaths | kill detected | freeze detected | 8 standbys "
            "of a host lost | the job failed | a successor's takeover (etcd): time, false deaths after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in coordinators:

            def ms(v):
                return "never" if v is None else f"{v:.0f} ms"

            lines.append(
                f"| {c['n']} | {c.get('store', 'tcp')} | {c.get('beats', 'store')} | {c['join_s']:.1f} s | "
                f"{c['coordinator_cpu_per_s']:.2f} s | "
                f"{c['poll_ms_median']:.1f} / {c['poll_ms_p99']:.1f} ms | {c['false_deaths']} | "
                f"{ms(c['detect_kill_ms'])} | {ms(c['detect_freeze_ms'])} | {ms(c['detect_lost_host_ms'])} | "
                f"{'no' if not c['job_failed'] else c['job_failed'][0]} | {takeover(c.get('takeover'))} |"
            )
    (out / "control_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "control_scale.png")


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (lat, req) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["store"] for r in results}):
        mine = sorted((r for r in results if r["store"] == kind), key=lambda r: r["n"])
        ns = [r["n"] for r in mine]
        lat.plot(ns, [r["commit_ms_median"] for r in mine], marker="o", label=f"{kind} median")
        lat.plot(ns, [r["commit_ms_p99"] for r in mine], marker=".", linestyle="--", label=f"{kind} p99")
        req.plot(ns, [r["requests_per_step"] for r in mine], marker="o", label=kind)
    for ax, title in ((lat, "commit after the last ack (ms)"), (req, "store requests per step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated ranks N")
        ax.set_title(title)
        ax.legend(fontsize="small")
    req.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def takeover(t: dict | None) -> str:
    """A coordinator run's takeover: how long the successor took to rebuild the job from
    etcd, and the members it then declared dead with no fault (— on a TCPStore: none)."""
    if not t:
        return "—"
    return f"{t['takeover_s'] * 1e3:.0f} ms, {t['false_deaths']}"


def merged(path: Path, results: list[dict], coordinators: list[dict]) -> tuple[list[dict], list[dict]]:
    """This run's results over the ones in ``path`` (kept where this run did not redo them)."""
    if not path.exists():
        return results, coordinators
    old = json.loads(path.read_text())

    def run_key(r: dict) -> tuple:
        return r["store"], r["n"]

    def coordinator_key(c: dict) -> tuple:
        return c.get("store", "tcp"), c["n"], c.get("beats", "store")

    redone, redone_c = {run_key(r) for r in results}, {coordinator_key(c) for c in coordinators}
    runs = [r for r in old.get("runs", []) if run_key(r) not in redone] + results
    kept = [c for c in old.get("coordinator", []) if coordinator_key(c) not in redone_c] + coordinators
    return sorted(runs, key=run_key), sorted(kept, key=coordinator_key)
