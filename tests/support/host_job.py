"""A job across network-namespace hosts, started as docs/failover.md's multi-node recipe
says, and the helpers that run processes on those hosts: used by tests/test_hosts.py,
tests/test_transport_nixl.py, tests/test_selftest_hosts.py and bench/test_failover_hosts.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from replica.timing import Deadline
from support.children import process_state
from support.etcd import EtcdCluster
from support.launch import EXAMPLE, RL, RL_STEPS, ROOT, STEPS, TOKEN, role_env

__all__ = ["Job", "STORE_PORT", "python_on", "reap"]


def python_on(host, *args: str, stdin=None, env: dict[str, str] | None = None, log=None) -> subprocess.Popen:
    """``python ARGS`` on ``host``, its output (stderr too) in a pipe the caller must keep reading,
    or in the open file ``log`` (a process that talks much and is read only at its end, such as an
    agent forwarding vLLM engines' logs: a full pipe would stop it and the roles whose output it
    forwards). The repository and tests/ are on its path: a program run so imports ``support``."""
    env = {
        **os.environ,
        "REPLICA_TOKEN": TOKEN,
        "UCX_LOG_LEVEL": "fatal",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
        **(env or {}),
    }
    return host.popen(
        [sys.executable, *args],
        env=env,
        cwd=ROOT,
        stdin=stdin,
        stdout=subprocess.PIPE if log is None else log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reap(*procs: subprocess.Popen | None) -> None:
    """Kill and wait for each process started (None: never started)."""
    for proc in procs:
        if proc is not None:
            proc.kill()
            proc.wait()


STORE_PORT = 29400


class Job:
    """Coordinator on host 0, trainers 0 and 1 on hosts 1 and 2, their standbys on 3 and 4
    (host 5 is spare); every process's output in a file of ``folder``. With ``etcd`` the
    job's state lives in that cluster and a second coordinator waits on host 5. With
    ``agents`` a `replica agent` on each of hosts 1-5 (indices 0-4) starts the roles
    (host 5's none) and the replacements the coordinator asks for. With ``rl`` the job is
    the RL loop (examples/rl_loop.py, RL_STEPS steps) with a vLLM engine beside each
    standby and one on host 5, started by the agents."""

    def __init__(
        self,
        cluster,
        folder: Path,
        inject: str = "",
        etcd: EtcdCluster | None = None,
        agents: bool = False,
        rl: bool = False,
        durable: Path | None = None,
        resume: Path | None = None,
        name: str = "run",
        spares: int = 0,
    ):
        self.folder, self.report = folder, folder / f"{name}.json"
        coord_host = cluster.hosts[0]
        agents = agents or rl
        script, steps, rollouts = (RL, RL_STEPS, 3) if rl else (EXAMPLE, STEPS, 0)
        extra = self._extra = {
            "REPLICA_EXPORT_DIR": str(folder / "export"),
            "REPLICA_STEPS": str(steps),
            "REPLICA_ROLLOUTS": str(rollouts),
        }
        if inject:
            extra["REPLICA_INJECT"] = inject
        if durable is not None:  # every third step, written by the standbys into one folder all hosts see
            extra.update(REPLICA_DURABLE=str(durable), REPLICA_DURABLE_EVERY="3", REPLICA_DURABLE_INTERVAL="0")
        if resume is not None:
            extra["REPLICA_RESUME"] = str(resume)
        if etcd is not None:
            extra.update(etcd.environ())
            self.store = f"etcd://{etcd.endpoints}/{etcd.namespace}"
            where = ["--store", self.store]
        else:
            self.store = f"{coord_host.address}:{STORE_PORT}"
            where = ["--host", coord_host.address, "--port", str(STORE_PORT)]
        self.procs: dict[str, subprocess.Popen] = {}
        coordinators = [("coordinator", coord_host, self.report)]
        if etcd is not None:
            coordinators.append(("coordinator-b", cluster.hosts[5], folder / "run-b.json"))
        for name, host, report in coordinators:
            # On etcd, each coordinator's --host is where its liveness endpoint listens (a takeover moves it).
            listen = ["--host", host.address] if etcd is not None else []
            self._start(
                name,
                host,
                [
                    "-m",
                    "replica.roles.cli",
                    "coordinator",
                    "--world-size",
                    "2",
                    "--steps",
                    str(steps),
                    "--rollouts",
                    str(rollouts),
                    *where,
                    *listen,
                    "--timeout",
                    "300",
                    "--report",
                    str(report),
                    *(["--agents", "5"] if agents else []),
                    *(["--spares", str(spares)] if spares else []),
                    *(["--resume", str(resume)] if resume is not None else []),
                ],
                dict(os.environ, REPLICA_TOKEN=TOKEN, **extra),
            )
            if etcd is not None:
                self.wait_output(name, "this coordinator leads" if name == "coordinator" else "waits to take over")
        # The watcher runs where no test kills: the coordinator's host, or host 5 beside etcd.
        self.watcher = python_on(
            cluster.hosts[5 if etcd is not None else 0],
            str(ROOT / "tests" / "jobs" / "wait_key.py"),
            self.store,
            "180",
            stdin=subprocess.PIPE,
            env=extra,
        )
        assert self._answer() == ["ready"], "the job store did not come up"
        if agents:
            placed = (
                ("trainer:0", "trainer:1", "standby:0,rollout:0", "standby:1,rollout:1", "rollout:2")
                if rl
                else ("trainer:0", "trainer:1", "standby:0", "standby:1", "")
            )
            for index, roles in enumerate(placed):
                host = cluster.hosts[index + 1]
                env = role_env(STORE_PORT, "", 0, GLOO_SOCKET_IFNAME="eth0", UCX_LOG_LEVEL="fatal", **self._extra)
                self._start(
                    f"agent{index}",
                    host,
                    [
                        "-m",
                        "replica.roles.cli",
                        "agent",
                        "--store",
                        self.store,
                        "--index",
                        str(index),
                        "--address",
                        host.address,
                        "--roles",
                        roles,
                        str(script),
                    ],
                    env,
                )
            return
        for role, first in (("standby", 3), ("trainer", 1)):
            for rank in (0, 1):
                self.start_role(f"{role}{rank}", role, rank, cluster.hosts[first + rank])

    def wait_output(self, name: str, text: str, timeout_s: float = 60) -> None:
        deadline = Deadline.after(timedelta(seconds=timeout_s))
        while text not in self.output(name):
            assert self.procs[name].poll() is None and not deadline.expired, (
                f"{name} never said {text!r}:\n{self.outputs()}"
            )
            time.sleep(0.05)

    def wait_stopped(self, name: str, where: str, timeout_s: float = 180) -> None:
        """Until process ``name`` stopped itself (an injected freeze at ``where``)."""
        deadline = Deadline.after(timedelta(seconds=timeout_s))
        proc = self.procs[name]
        while process_state(proc.pid) != "T":
            assert proc.poll() is None and self.procs["coordinator"].poll() is None, self.outputs()
            assert not deadline.expired, f"{name} never reached {where}"
            time.sleep(0.05)

    def lose_pair(self, trainer_host, standby_host, timeout_s: float = 180) -> None:
        """A rank's trainer and standby lost together: once a process on ``trainer_host`` stopped
        itself (an injected freeze: the loss comes at a known point), ``standby_host`` is lost
        whole, then ``trainer_host`` (the caller heals both)."""

        def stopped(pid: int) -> bool:
            try:
                return process_state(pid) == "T"
            except FileNotFoundError:  # it exited since the host listed it
                return False

        deadline = Deadline.after(timedelta(seconds=timeout_s))
        while not any(stopped(pid) for pid in trainer_host.pids()):
            assert self.procs["coordinator"].poll() is None and not deadline.expired, self.outputs()
            time.sleep(0.05)
        assert standby_host.crash() and trainer_host.crash()

    def start_role(self, name: str, role: str, rank: int, host, *, held: bool = False) -> None:
        """A role as docs/failover.md's recipe starts one, on ``host``. ``held``: started now
        but held after its imports until ``release(name)`` (tests/jobs/held_role.py)."""
        env = role_env(
            STORE_PORT,
            role,
            rank,
            REPLICA_STORE=self.store,
            REPLICA_HOST=host.address,
            GLOO_SOCKET_IFNAME="eth0",
            UCX_LOG_LEVEL="fatal",
            **self._extra,
        )
        args = [str(ROOT / "tests" / "jobs" / "held_role.py"), str(EXAMPLE)] if held else [str(EXAMPLE)]
        self._start(name, host, args, env, stdin=subprocess.PIPE if held else None)

    def release(self, name: str) -> None:
        """Let a held role go on (at once, or as soon as its imports are done)."""
        self.procs[name].stdin.write(b"go\n")
        self.procs[name].stdin.flush()

    def _start(self, name: str, host, args: list[str], env: dict[str, str], stdin=None) -> None:
        with open(self.folder / f"{name}.log", "w") as log:
            self.procs[name] = host.popen(
                [sys.executable, *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=stdin
            )

    def output(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.output(name)[-3000:]}" for name in self.procs)

    def _answer(self) -> list[str]:
        """The watcher's next line, past torch's warnings."""
        while line := self.watcher.stdout.readline():
            if line.split()[:1] in (["ready"], ["ok"], ["timeout"]):
                return line.split()
        return []

    def wait_for_key(self, key: str) -> None:
        """Until ``key`` is in the job store (asked from the coordinator's host)."""
        self.watcher.stdin.write(key + "\n")
        self.watcher.stdin.flush()
        answer = self._answer()
        assert answer == ["ok", key], f"{key} never appeared ({answer}):\n{self.outputs()}"

    def finish(self, timeout_s: float = 240) -> dict[str, int | None]:
        """Wait for every process (the coordinator first); kill what is left. Exit codes by name."""
        deadline = Deadline.after(timedelta(seconds=timeout_s))
        try:
            for proc in self.procs.values():
                proc.wait(timeout=max(1.0, deadline.remaining_s()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()
        return {name: p.returncode for name, p in self.procs.items()}

    def partitioned(self, host, *, after: str, meanwhile: Callable[[], None]) -> dict[str, int | None]:
        """Cut ``host`` off once ``after`` is in the store, run ``meanwhile``, heal it and
        finish the job; exit codes by name."""
        try:
            self.wait_for_key(after)
            host.partition()
            try:
                meanwhile()
            finally:
                host.heal()
            return self.finish()
        finally:
            self.kill()
            host.heal()

    def crash_after(self, key: str, host, *, holding: str) -> tuple[float, dict[str, int | None]]:
        """Lose ``host`` whole once ``key`` is in the store (``holding``: a process that must
        die with it) and finish the job; when it was lost, and the exit codes by name."""
        try:
            self.wait_for_key(key)
            lost_at = time.time()
            assert self.procs[holding].pid in host.crash()
            return lost_at, self.finish()
        finally:
            self.kill()
            host.heal()

    def kill(self) -> None:
        for proc in (*self.procs.values(), self.watcher):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
