"""``replica selftest --agents`` across network-namespace hosts, as a user runs it on a cluster:
``replica agent --serve`` on hosts 1-5 (agents 0-4), the selftest on host 0, where each job's
coordinator listens; the whole matrix: the host case, the durable one and the RL loop's.

Each agent's output goes to a file as it comes. Read through a pipe only at the end, the output
of an agent's roles (its vLLM engines' logs) filled the pipe by the third engine, and that engine
hung in its start-up writing a warning."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from replica.roles.selftest import select_cases
from support import cluster as testcluster
from support.cluster import ClusterConfig, NetnsCluster
from support.host_job import python_on, reap

pytestmark = [pytest.mark.netns, pytest.mark.skipif(not testcluster.available(), reason="needs root and `ip netns`")]

PORT = 29410
AGENTS = 5
CASES = tuple(c.name for c in select_cases(quick=False, durable=True, agents=True))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole matrix: 24 runs
def test_full_matrix_on_serving_agents_across_hosts(tmp_path):
    work = tmp_path / "work"
    with NetnsCluster(ClusterConfig(hosts=1 + AGENTS)) as cluster, ExitStack() as files:
        coordinator = cluster.hosts[0]
        logs = [files.enter_context(open(tmp_path / f"agent{i}.log", "w")) for i in range(AGENTS)]
        agents = [
            python_on(
                host,
                "-m",
                "replica.roles.cli",
                "agent",
                "--store",
                f"{coordinator.address}:{PORT}",
                "--index",
                str(i),
                "--address",
                host.address,
                "--serve",
                "--idle-timeout",
                "300",
                env={"GLOO_SOCKET_IFNAME": "eth0"},
                log=logs[i],
            )
            for i, host in enumerate(cluster.hosts[1:])
        ]
        selftest = python_on(
            coordinator,
            "-m",
            "replica.roles.cli",
            "selftest",
            "--agents",
            str(AGENTS),
            "--host",
            coordinator.address,
            "--port",
            str(PORT),
            "--report",
            str(work),
            "--durable",
            str(tmp_path / "floor"),
            *(arg for case in CASES for arg in ("--case", case)),
        )
        try:
            said, _ = selftest.communicate(timeout=1700)
        finally:
            reap(selftest, *agents)
    logs = [(tmp_path / f"agent{i}.log").read_text() for i in range(AGENTS)]
    assert selftest.returncode == 0, said[-8000:]
    summary = json.loads((work / "selftest.json").read_text())
    ran = {r["case"]: r for r in summary["results"]}
    skipped = {name for name, r in ran.items() if r["outcome"] == "skipped"}
    assert skipped <= {"hf-optimizer"}, skipped
    assert set(CASES) <= set(ran), ran
    for case in select_cases(quick=False, durable=True, agents=True, only=CASES):
        if case.name not in skipped:
            assert ran[case.name]["outcome"] == "bit-identical", ran[case.name]
            report = json.loads((work / case.name / "run.json").read_text())
            assert all(f["fired_at"] is not None for f in report["faults"]), (case.name, report["faults"])
    lost = json.loads((work / "host-lost" / "run.json").read_text())
    assert [f["rank"] for f in lost["failovers"]] == [1], lost["failovers"]
    # Roles ran on the agents' hosts: trainer r on agent r's host (the coordinator's placement).
    first = {m["rank"]: m["host"] for m in lost["members"] if m["role"] == "trainer" and m["state"] == "dead"}
    assert first == {1: cluster.hosts[2].hostname}, lost["members"]
    assert "its host lost in the job" in logs[1], logs[1][-3000:]
    print("\n".join(line for line in said.splitlines() if line.startswith("|")))
