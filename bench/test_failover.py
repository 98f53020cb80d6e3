"""Failover against checkpoint-restart on the demo job (2 FSDP2 CPU trainers).

replica: `replica launch` with trainer 1 SIGKILLed in the backward of step
KILL_STEP; the timeline (detect, promote, reconnect, resumed) comes from the
job report, medians over ROUNDS kills. The same with trainer 1 frozen
(SIGSTOP: only the heartbeat deadline finds it), the kill again with two busy
processes per core, and LOADED_RUNS fault-free runs under that load, where any
failover is a false death. Baseline: the same job on plain gloo
saving a torch.distributed.checkpoint every CKPT_EVERY steps; rank 1 is
SIGKILLed at step KILL_STEP, every rank is restarted, loads the newest
checkpoint and recomputes the lost steps. Both figures are "kill -> step
KILL_STEP finished again". `make bench` writes bench/results/failover.json."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from bench_results import machine, write_results

from replica.roles.coordinator import Deadlines
from replica.timing import Deadline
from support.cpu import busy_cores
from support.launch import launch
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_STEP, CKPT_EVERY = 16, 9, 5
ROUNDS = 5
LOADED_RUNS = 10  # fault-free runs with both cores kept busy: any failover in them is a false death
_results: dict[str, list[dict]] = {}


def _resumed_at(times: list[float | None]) -> float:
    return times[KILL_STEP - 1]


def _bench_only(benchmark) -> None:
    if benchmark.disabled:  # CI's time budget: tests/test_launch.py runs the same failovers
        pytest.skip("runs under `make bench` only")


def _failover_run(tmp_path: Path, fault: str, name: str) -> dict:
    """One `replica launch` with ``fault`` on trainer 1 at KILL_STEP: its timeline."""
    code, report, output = launch(
        tmp_path, "--steps", str(STEPS), "--inject", f"{fault}:trainer:1@{KILL_STEP}:backward", name=name
    )
    assert code == 0 and len(report["failovers"]) == 1, output[-3000:]
    failover = report["failovers"][0]
    times = report["step_end_times"]["0"]
    steady = [b - a for a, b in zip(times[1 : KILL_STEP - 2], times[2 : KILL_STEP - 1], strict=False)]
    return {
        **failover["timeline_ms"],
        "kill_to_step_done_ms": (_resumed_at(times) - failover["killed_at"]) * 1e3,
        "step_ms": statistics.median(steady) * 1e3,
        "lost_steps": KILL_STEP - 1 - failover["commit"],
        "max_heartbeat_silence_s": max(m["max_silence_s"] for m in report["members"]),
    }


def _failovers(benchmark, tmp_path: Path, fault: str, name: str) -> list[dict]:
    _bench_only(benchmark)
    runs = []
    benchmark.pedantic(
        lambda: runs.append(_failover_run(tmp_path, fault, f"{name}{len(runs)}")), rounds=ROUNDS, iterations=1
    )
    return runs


def test_replica_failover(benchmark, tmp_path):
    _results["replica"] = _failovers(benchmark, tmp_path, "kill", "kill")


def test_frozen_trainer_failover(benchmark, tmp_path):
    """Trainer 1 SIGSTOPs itself (a hung machine: no exit, no transport report, its
    connections stay open): only the heartbeat deadline finds it."""
    _results["frozen"] = _failovers(benchmark, tmp_path, "freeze", "freeze")


def test_replica_failover_under_load(benchmark, tmp_path):
    """The kill of test_replica_failover with two busy processes per core all along."""
    with busy_cores() as load:
        _results["loaded"] = _failovers(benchmark, tmp_path, "kill", "loaded")
        assert load.all_alive()


def test_false_deaths_under_load(benchmark, tmp_path):
    """LOADED_RUNS fault-free jobs with two busy processes per core all along: every
    failover, standby replacement or regroup in them is a healthy role taken for dead
    (or a step redone for nothing). Must be 0."""
    _bench_only(benchmark)
    runs = []

    def one_run():
        code, report, output = launch(tmp_path, "--steps", str(STEPS), name=f"quiet{len(runs)}")
        assert code == 0, output[-3000:]
        runs.append(
            {
                "false_deaths": len(report["failovers"]) + len(report["standbys_replaced"]),
                "regroups": len(report["regroups"]),
                "max_heartbeat_silence_s": max(m["max_silence_s"] for m in report["members"]),
            }
        )

    with busy_cores() as load:
        benchmark.pedantic(one_run, rounds=LOADED_RUNS, iterations=1)
        assert load.all_alive() and load.cpu_seconds() > 0
    _results["false_deaths"] = runs


def test_pair_loss_from_the_floor(benchmark, tmp_path):
    """Trainer 1 and its standby both lost (the standby killed two steps before the trainer, no
    replacement allowed): the job goes back to the durable floor (written every CKPT_EVERY steps,
    as the baseline's checkpoints) and replays. Trainer 0 stalls 2 s in step KILL_STEP - 3, time
    for the floor's version before the kill to complete (a standby's fsyncs lag on 2 cores)."""
    _bench_only(benchmark)
    runs = []
    inject = f"stall:trainer:0@{KILL_STEP - 3}:2,kill:standby:1@{KILL_STEP - 2},kill:trainer:1@{KILL_STEP}:backward"

    def one_pair_loss():
        folder = tmp_path / f"pair{len(runs)}"
        code, report, output = launch(
            tmp_path,
            "--steps",
            str(STEPS),
            "--durable",
            str(folder),
            "--durable-every",
            str(CKPT_EVERY),
            "--durable-interval",
            "0",
            "--replacements",
            "0",
            "--inject",
            inject,
            name=f"pair{len(runs)}",
        )
        assert code == 0, output[-3000:]
        (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
        killed = next(f["fired_at"] for f in report["faults"] if f["fault"].startswith("kill:trainer"))
        runs.append(
            {
                "kill_to_step_done_ms": (_resumed_at(report["step_end_times"]["0"]) - killed) * 1e3,
                "lost_steps": KILL_STEP - 1 - resumed["resumed_from_floor"],
                "replayed_steps": resumed["lost_commit"] - resumed["resumed_from_floor"],
            }
        )

    benchmark.pedantic(one_pair_loss, rounds=ROUNDS, iterations=1)
    _results["pair"] = runs


def _run_baseline(directory: Path, **env) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "ckpt_job.py")],
            cwd=ROOT,
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                CKPT_DIR=str(directory),
                CKPT_EVERY=str(CKPT_EVERY),
                STEPS=str(STEPS),
                PYTHONPATH=str(ROOT / "examples"),
                **env,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    deadline = Deadline.after(timedelta(seconds=300))
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(0.05)  # one rank died: the job is lost, as a torchrun job would be; stop the rest
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if deadline.expired:
            for p in procs:
                p.kill()
            raise TimeoutError("baseline job did not finish")
        time.sleep(0.01)


def test_checkpoint_restart(benchmark, tmp_path):
    _bench_only(benchmark)
    runs = []

    def one_kill():
        directory = tmp_path / f"ckpt{len(runs)}"
        directory.mkdir()
        _run_baseline(directory, KILL_AT=str(KILL_STEP))
        killed = float((directory / "killed").read_text())
        _run_baseline(directory, RESUME="1")
        done = {}
        for line in (directory / "progress.0").read_text().split("\n"):
            if line:
                step, at = line.split()
                done[int(step)] = float(at)  # the later run's time wins
        assert set(done) == set(range(1, STEPS + 1))
        last_checkpoint = (KILL_STEP - 1) // CKPT_EVERY * CKPT_EVERY
        runs.append(
            {"kill_to_step_done_ms": (done[KILL_STEP] - killed) * 1e3, "lost_steps": KILL_STEP - 1 - last_checkpoint}
        )

    benchmark.pedantic(one_kill, rounds=ROUNDS, iterations=1)
    _results["checkpoint"] = runs


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    if request.config.getoption("benchmark_disable") or not {"replica", "checkpoint"} <= set(_results):
        return

    def median(runs, key):
        return statistics.median(r[key] for r in runs)

    ours, base = _results["replica"], _results["checkpoint"]
    frozen, loaded, quiet = (_results.get(k, []) for k in ("frozen", "loaded", "false_deaths"))
    result = {
        "detect_ms": median(ours, "detect"),
        "promote_ms": median(ours, "promote"),
        "reconnect_ms": median(ours, "reconnect"),
        "resume_ms": median(ours, "kill_to_step_done_ms"),
        "step_ms": median(ours, "step_ms"),
        "lost_steps_replica": median(ours, "lost_steps"),
        "checkpoint_restart_ms": median(base, "kill_to_step_done_ms"),
        "lost_steps_checkpoint_restart": median(base, "lost_steps"),
        "frozen_detect_ms": median(frozen, "detect") if frozen else None,
        "frozen_resume_ms": median(frozen, "kill_to_step_done_ms") if frozen else None,
        "resume_under_load_ms": median(loaded, "kill_to_step_done_ms") if loaded else None,
        "detect_under_load_ms": median(loaded, "detect") if loaded else None,
        "false_deaths_under_load": sum(r["false_deaths"] for r in quiet) if quiet else None,
        "regroups_under_load": sum(r["regroups"] for r in quiet) if quiet else None,
        "loaded_runs": len(quiet),
        "max_heartbeat_silence_under_load_s": max((r["max_heartbeat_silence_s"] for r in quiet + loaded), default=None),
        "heartbeat_deadline_s": Deadlines().trainer.total_seconds(),
        "config": {
            "steps": STEPS,
            "kill_step": KILL_STEP,
            "checkpoint_every": CKPT_EVERY,
            "rounds": len(ours),
            "trainers": 2,
            "load": "2 busy processes per core",
        },
        "runs": {
            "replica": ours,
            "checkpoint_restart": base,
            "frozen": frozen,
            "under_load": loaded,
            "quiet_under_load": quiet,
        },
        "machine": machine(),
    }
    result["speedup_vs_checkpoint_restart"] = result["checkpoint_restart_ms"] / result["resume_ms"]
    r = result
    lines = [
        f"### failover vs checkpoint-restart, demo job, 2 FSDP2 CPU trainers (medians of {len(ours)} kills)\n",
        "| | kill -> step finished again | detect | promote | reconnect | steps lost beyond the one in flight |",
        "|---|---|---|---|---|---|",
        f"| replica | {r['resume_ms']:.0f} ms | {r['detect_ms']:.0f} ms | {r['promote_ms']:.0f} ms | "
        f"{r['reconnect_ms']:.0f} ms | {r['lost_steps_replica']:g} |",
        f"| checkpoint-restart (DCP every {CKPT_EVERY} steps) | {r['checkpoint_restart_ms']:.0f} ms | | | | "
        f"{r['lost_steps_checkpoint_restart']:g} |",
        f"\nspeedup {r['speedup_vs_checkpoint_restart']:.1f}x (target >= 10x); step time {r['step_ms']:.0f} ms",
    ]
    if pair := _results.get("pair"):
        result["pair_loss_ms"] = median(pair, "kill_to_step_done_ms")
        result["lost_steps_pair_loss"] = median(pair, "lost_steps")
        result["runs"]["pair_loss"] = pair
        lines.insert(
            4,
            f"| replica, trainer lost with its standby (back to the durable floor, every {CKPT_EVERY} "
            f"steps) | {result['pair_loss_ms']:.0f} ms | | | | {result['lost_steps_pair_loss']:g} |",
        )
        lines.append(
            f"pair loss against checkpoint-restart: {r['checkpoint_restart_ms'] / result['pair_loss_ms']:.1f}x"
        )
    if frozen:
        lines.append(
            f"frozen (SIGSTOP) trainer: detected in {r['frozen_detect_ms']:.0f} ms (target <= 3000, "
            f"deadline {r['heartbeat_deadline_s']:g} s), step finished again {r['frozen_resume_ms']:.0f} ms "
            "after the freeze"
        )
    if loaded:
        lines.append(
            f"kill under load (2 busy processes per core): detect {r['detect_under_load_ms']:.0f} ms, step "
            f"finished again {r['resume_under_load_ms']:.0f} ms after the kill"
        )
    if quiet:
        lines.append(
            f"false deaths under load: {r['false_deaths_under_load']} in {len(quiet)} fault-free runs "
            f"(target 0; regroups {r['regroups_under_load']}); longest heartbeat silence "
            f"{r['max_heartbeat_silence_under_load_s']:.2f} s against a {r['heartbeat_deadline_s']:g} s "
            "deadline"
        )
    write_results("failover", result, lines)
