"""Failover across hosts (network namespaces, tests/support/host_job.py's job on tests/test_hosts.py's cluster):
the timeline (detect, promote, reconnect, resumed, from the fault's own stamp) of
trainer 1's host lost whole (link cut, then everything killed: no reset reaches
anyone) and of that host partitioned for 8 s (``--inject partition:host:1@4:8``),
and how long after the active coordinator's host is lost (with an etcd member on
it) the other coordinator takes over. Medians of ROUNDS runs each, beside the
same job's failover of a killed process on one machine (bench/test_failover.py's
figure, the floor: no deadline to wait for). `make bench` writes
bench/results/failover_hosts.json and .md."""

from __future__ import annotations

import json
import statistics
from datetime import timedelta

import pytest
from bench_results import machine, write_results

from replica.roles.coordinator import Deadlines
from replica.timing import Deadline, pause
from support import cluster as testcluster
from support import etcd as testetcd
from support.children import process_state
from support.cluster import ClusterConfig, NetnsCluster
from support.etcd import EtcdCluster
from support.host_job import Job

pytestmark = pytest.mark.skipif(not testcluster.available(), reason="needs root and `ip netns`")

ROUNDS = 3
_results: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def cluster(request):
    if request.config.getoption("benchmark_disable"):  # CI's time budget: tests/test_hosts.py runs each once
        pytest.skip("runs under `make bench` only")
    with NetnsCluster(ClusterConfig(hosts=6)) as c:
        yield c


def _timeline(job: Job) -> dict:
    report = json.loads(job.report.read_text())
    (failover,) = report["failovers"]
    return {**failover["timeline_ms"], "commit": failover["commit"], "reason": failover["reason"]}


@pytest.mark.parametrize("phase", ["backward", "reduce-scatter"])
def test_trainer_host_lost(benchmark, cluster, tmp_path, phase):
    """In the backward the survivor waits in an all-gather; in the reduce-scatter, in FSDP2's
    gradient reduce-scatter (which gloo's own wait would hold to its 10 s timeout)."""
    runs = []

    def one() -> None:
        folder = tmp_path / f"lost{len(runs)}"
        folder.mkdir()
        # The trainer freezes itself in step 5 (its stamp is the fault's time); then its host is lost.
        job = Job(cluster, folder, inject=f"freeze:trainer:1@5:{phase}")
        try:
            doomed = job.procs["trainer1"]
            deadline = Deadline.after(timedelta(seconds=180))
            while process_state(doomed.pid) != "T" and not deadline.expired:
                pause(timedelta(milliseconds=20))
            cluster.hosts[2].crash()
            codes = job.finish()
        finally:
            job.kill()
            cluster.hosts[2].heal()
        assert codes["coordinator"] == 0, job.outputs()
        runs.append(_timeline(job))

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1)
    _results["host_lost" if phase == "backward" else "host_lost_in_reduce_scatter"] = runs


def test_trainer_host_partitioned(benchmark, cluster, tmp_path):
    runs = []

    def one() -> None:
        folder = tmp_path / f"cut{len(runs)}"
        folder.mkdir()
        job = Job(cluster, folder, inject="partition:host:1@4:8", agents=True)
        try:
            codes = job.finish()
        finally:
            job.kill()
        assert codes["coordinator"] == 0, job.outputs()
        runs.append(_timeline(job))

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1)
    _results["host_partitioned"] = runs


def test_coordinator_host_lost_with_etcd(benchmark, cluster, tmp_path):
    if not testetcd.available():
        pytest.skip("etcd is not installed")
    runs = []
    hosts = [cluster.hosts[i] for i in (0, 3, 4)]

    def one() -> None:
        folder = tmp_path / f"coord{len(runs)}"
        folder.mkdir()
        with EtcdCluster(
            addresses=[h.address for h in hosts],
            base_port=2379,
            spawns=[h.popen for h in hosts],
            via=[h.command for h in hosts],
        ) as etcd:
            job = Job(cluster, folder, etcd=etcd)
            lost_at, codes = job.crash_after("replica/loss/1/3", cluster.hosts[0], holding="coordinator")
        assert codes["coordinator-b"] == 0, job.outputs()
        report = json.loads((folder / "run-b.json").read_text())
        steps = [t for t in report["step_end_times"]["0"] if t is not None and lost_at < t < report["takeover"]["at"]]
        runs.append({"takeover_ms": (report["takeover"]["at"] - lost_at) * 1e3, "steps_meanwhile": len(steps)})

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1)
    _results["coordinator_lost"] = runs


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    if request.config.getoption("benchmark_disable") or not _results:
        return

    def median(runs: list[dict], key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    result: dict = {
        "rounds": ROUNDS,
        "heartbeat_deadline_s": Deadlines().trainer.total_seconds(),
        "runs": _results,
        "machine": machine(),
    }
    lines = [
        f"### failover across hosts (network namespaces; medians of {ROUNDS} runs, ms after the fault)\n",
        "| fault | detect | promote | reconnect | resumed |",
        "|---|---|---|---|---|",
    ]
    for name, title in (
        ("host_lost", "trainer's host lost whole (no reset), in the backward"),
        ("host_lost_in_reduce_scatter", "the same, in the gradient reduce-scatter"),
        ("host_partitioned", "trainer's host partitioned 8 s"),
    ):
        runs = _results.get(name, [])
        if runs:
            row = {k: median(runs, k) for k in ("detect", "promote", "reconnect", "resumed")}
            result[name] = row
            lines.append(
                f"| {title} | " + " | ".join(f"{v:.0f}" if v is not None else "-" for v in row.values()) + " |"
            )
    if _results.get("coordinator_lost"):
        runs = _results["coordinator_lost"]
        result["coordinator_takeover_ms"] = median(runs, "takeover_ms")
        result["steps_during_takeover"] = median(runs, "steps_meanwhile")
        lines.append(
            f"\nactive coordinator's host lost (with an etcd member): the other one led "
            f"{result['coordinator_takeover_ms']:.0f} ms later (target <= 5000 ms); "
            f"{result['steps_during_takeover']:g} steps committed meanwhile"
        )
    lines.append(
        f"\nthe heartbeat deadline is {result['heartbeat_deadline_s']:g} s: a lost or cut-off host is "
        "found by it (no process exit, no reset); the survivors leave their collective when the failover "
        "is announced (resumed: the first step after the failover done)"
    )
    write_results("failover_hosts", result, lines)
