"""Failover on Ray beside the local launcher, on the same job (the demo: 2 FSDP2 CPU
trainers, 2 standbys), in the same run: trainer 1 SIGKILLed in the backward of step
KILL_STEP, ROUNDS times each; the timeline (detect, promote, reconnect, resumed) from the
job report, and the start-up time (launch -> end of step 1). The Ray cluster is
``ray.cluster_utils.Cluster`` (a head and 5 simulated nodes, each its own raylet) on this
machine. `make bench` adds the figures under ``"ray"`` in bench/results/failover.json
(and writes failover_ray.md)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="replica[ray] is not installed")

from bench_results import RESULTS_DIR, machine  # noqa: E402

from support.launch import launch  # noqa: E402

STEPS, KILL_STEP, ROUNDS = 12, 7, 3
_runs: dict[str, list[dict]] = {"local": [], "ray": []}


def _one(tmp_path: Path, name: str, *options: str) -> dict:
    started = time.time()
    code, report, output = launch(
        tmp_path, "--steps", str(STEPS), "--inject", f"kill:trainer:1@{KILL_STEP}:backward", *options, name=name
    )
    assert code == 0 and len(report["failovers"]) == 1, output[-3000:]
    failover, times = report["failovers"][0], report["step_end_times"]["0"]
    return {
        **failover["timeline_ms"],
        "startup_s": times[0] - started,
        "kill_to_step_done_ms": (times[KILL_STEP - 1] - failover["killed_at"]) * 1e3,
    }


def test_failover_on_ray_beside_local(benchmark, request, tmp_path):
    if benchmark.disabled:  # tests/test_ray.py runs the failovers in `make test`
        pytest.skip("runs under `make bench` only")
    cluster = request.getfixturevalue("ray_cluster")  # only now: a skipped bench starts no cluster

    def both():
        n = len(_runs["ray"])
        _runs["local"].append(_one(tmp_path, f"local{n}"))
        _runs["ray"].append(_one(tmp_path, f"ray{n}", "--ray", cluster.address))

    benchmark.pedantic(both, rounds=ROUNDS, iterations=1)
    keys = ("detect", "promote", "reconnect", "resumed", "kill_to_step_done_ms", "startup_s")
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in keys} for kind, runs in _runs.items()}
    path = RESULTS_DIR / "failover.json"
    RESULTS_DIR.mkdir(exist_ok=True)
    results = json.loads(path.read_text()) if path.exists() else {}
    results["ray"] = {
        "medians": medians,
        "runs": _runs,
        "rounds": ROUNDS,
        "steps": STEPS,
        "kill_step": KILL_STEP,
        "cluster": "ray.cluster_utils.Cluster: head (0 CPUs) + 5 nodes x 2 CPUs, one machine",
        "ray": ray.__version__,
        "machine": machine(),
    }
    path.write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"### failover on Ray beside the local launcher (same job, medians of {ROUNDS} kills each)\n",
        "| launcher | start-up (launch -> step 1) | detect | promote | reconnect | resumed | kill -> step done |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, m in medians.items():
        lines.append(
            f"| {kind} | {m['startup_s']:.1f} s | {m['detect']:.0f} ms | {m['promote']:.0f} ms | "
            f"{m['reconnect']:.0f} ms | {m['resumed']:.0f} ms | {m['kill_to_step_done_ms']:.0f} ms |"
        )
    (RESULTS_DIR / "failover_ray.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    assert all(len(r) == ROUNDS for r in _runs.values())
