"""Host agents that serve job after job (``replica agent --serve``), and ``replica selftest
--agents`` on them: the matrix's jobs each served by their coordinator to the same agents, on
this machine (each agent a failure domain of its own). tests/test_selftest_hosts.py runs the
whole matrix on agents across network-namespace hosts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replica import envvars
from replica.jobstore import ServedJob
from replica.roles.env import Role
from replica.roles.served import first_placement, served_job_refusal
from support.ports import free_port

TOKEN = "served-test-token"
CLI = [sys.executable, "-m", "replica.roles.cli"]


def _agent(index: int, port: int, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *CLI,
            "agent",
            "--store",
            f"127.0.0.1:{port}",
            "--index",
            str(index),
            "--domain",
            f"d{index}",
            "--serve",
            *extra,
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, envvars.TOKEN: TOKEN},
        start_new_session=True,
    )


@contextlib.contextmanager
def _agents(n: int, port: int, folder: Path, *extra: str):
    procs = [_agent(i, port, folder / f"agent{i}.log", *extra) for i in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_agent_refuses_a_job_it_cannot_run(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    assert served_job_refusal(ServedJob(id="a", script=str(script), environ={envvars.STEPS: "3"})) == ""
    assert "is not on this host" in served_job_refusal(ServedJob(id="a", script=str(tmp_path / "missing.py")))
    assert "is not on this host" in served_job_refusal(ServedJob(id="a", script="job.py"))  # relative: refused
    for name in (envvars.TOKEN, envvars.STORE, "LD_PRELOAD"):
        why = served_job_refusal(ServedJob(id="a", script=str(script), environ={name: "x"}))
        assert f"it sets {name}" in why, why


def test_a_served_job_places_every_role():
    assert first_placement(world_size=2, standbys=1, rollouts=1) == {
        (Role.TRAINER, 0): "",
        (Role.TRAINER, 1): "",
        (Role.STANDBY, 0): "",
        (Role.ROLLOUT, 0): "",
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (("--serve", "job.py"), "--serve takes no SCRIPT and no --roles"),
        (("--serve", "--roles", "trainer:0"), "--serve takes no SCRIPT and no --roles"),
        ((), "the job's SCRIPT is required (or --serve"),
    ],
)
def test_serve_and_a_script_exclude_each_other(tmp_path, args, message):
    (tmp_path / "job.py").write_text("")
    done = subprocess.run(
        [*CLI, "agent", "--store", "127.0.0.1:1", "--index", "0", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, envvars.TOKEN: TOKEN},
    )
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_serving_agent_stops_when_no_job_comes(tmp_path):
    with _agents(1, free_port(), tmp_path, "--idle-timeout", "2") as (agent,):
        assert agent.wait(timeout=60) == 0
    said = (tmp_path / "agent0.log").read_text()
    assert "serves the jobs at" in said and "no new job for 2 s; it stops" in said, said


def test_selftest_port_in_use_exits_2(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [*CLI, "selftest", "--agents", "3", "--port", str(port), "--report", str(tmp_path / "w")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, envvars.TOKEN: TOKEN},
        )
    assert done.returncode == 2 and f"--port {port}: cannot listen there for the agents" in done.stderr, done.stderr
    assert not (tmp_path / "w").exists()


def test_selftest_on_serving_agents_runs_job_after_job_and_loses_a_host(tmp_path):
    """Three serving agents; ``replica selftest --agents 3 --case host-lost``: the unmirrored
    baseline, the reference and the case, each a `replica coordinator` that serves its job to the
    same agents. In the case, host 1 (trainer 1's, the coordinator placing trainer r on agent r)
    is lost in step 5: its agent kills its roles and falls silent in that job; trainer 1's
    standby takes over, bit-identical; the agent then serves the next job (none here)."""
    port = free_port()
    work = tmp_path / "work"
    with _agents(3, port, tmp_path, "--idle-timeout", "120"):
        done = subprocess.run(
            [
                *CLI,
                "selftest",
                "--agents",
                "3",
                "--port",
                str(port),
                "--case",
                "host-lost",
                "--steps",
                "8",
                "--report",
                str(work),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, envvars.TOKEN: TOKEN},
        )
    logs = {i: (tmp_path / f"agent{i}.log").read_text() for i in range(3)}
    assert done.returncode == 0, (done.stdout[-4000:], logs)
    summary = json.loads((work / "selftest.json").read_text())
    assert summary["target"] == f"3 host agents (127.0.0.1:{port})", summary
    outcomes = {r["case"]: r["outcome"] for r in summary["results"]}
    assert outcomes == {
        "fsdp-unmirrored": "baseline",
        "fsdp-reference": "bit-identical",
        "host-lost": "bit-identical",
    }, summary
    report = json.loads((work / "host-lost" / "run.json").read_text())
    (fault,) = report["faults"]
    assert fault["fault"] == "kill:host:1@5" and fault["fired_at"], fault
    (failover,) = report["failovers"]
    assert failover["rank"] == 1, failover
    # Every agent served the three jobs, one after the other; agent 1 lost its host in the last.
    for i, said in logs.items():
        assert said.count(f"replica: agent {i} serves the job ") == 3, said
    assert "its host lost in the job (an injected fault)" in logs[1], logs[1]
