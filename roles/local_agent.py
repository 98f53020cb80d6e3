"""The local agent: the role processes of this machine, started as one user script each
(``replica launch`` starts a whole job so; ``replica agent`` one host's share of it), each
dying with the process that started it, even one killed with SIGKILL; their exits
reported to the coordinator's loop. Also ``open_job`` and ``start_roles``: a job's
coordinator and its first roles, for the launcher and the Ray layer alike."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.errors import MainThreadError
from replica.jobstore.stores import StoreAddress, StoreKind
from replica.mirror.floor import FloorConfig
from replica.processes import ScriptProcess, start_script
from replica.roles.coordinator import Coordinator
from replica.roles.election import Leadership, lead_new_job
from replica.roles.env import Role, base_environ, host_name, job_environ, member_environ, role_name
from replica.roles.probe import ProcessView, Verdict, verdict_of
from replica.roles.spares import Replacements
from replica.roles.timing import Deadlines
from replica.session.backends import check_backends, parse_backends
from replica.timing import Deadline

__all__ = ["LocalAgent", "die_with_launcher", "open_job", "role_env", "start_roles"]


# Run as `python -I -S -c _DIE_WITH_LAUNCHER LAUNCHER_PID ARGV...`, before anything of the job is
# imported: set PR_SET_PDEATHSIG, then exec ARGV in the same process (the setting survives exec, and
# the script runs exactly as `python script.py` would). This replaces preexec_fn, which may deadlock
# in a launcher with threads. The signal comes when the launcher's forking thread exits; one that
# died before the prctl sends nothing, so the parent is checked after it.
_DIE_WITH_LAUNCHER = """\
import ctypes, os, signal, sys
launcher, argv = int(sys.argv[1]), sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
              ctypes.c_ulong(0)) != 0:  # 1: PR_SET_PDEATHSIG
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != launcher:
    os.kill(os.getpid(), signal.SIGKILL)
os.execv(argv[0], argv)
"""


def die_with_launcher(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process it starts is SIGKILLed when this process
    dies (Linux; elsewhere ``argv`` unchanged). Start it from the main thread: the
    signal fires when the thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]


def role_env(
    *,
    store: str,
    token: str,
    world_size: int,
    inject: str,
    steps: int,
    rollouts: int,
    mirror_device: str,
    export_dir: Path,
    resume: Path | None,
    backends: str = "",
    strict: bool = False,
    durable: FloorConfig | None = None,
    attempt: int = 0,
) -> dict[str, str]:
    """The environment every role of a launched job starts with (this one's, plus the job's:
    ``replica.roles.env.job_environ``, which ``RoleEnv.from_environ`` reads)."""
    return {
        **base_environ(),
        **job_environ(
            store=store,
            token=token,
            world_size=world_size,
            steps=steps,
            inject=inject,
            rollouts=rollouts,
            mirror_device="" if mirror_device == "model" else mirror_device,
            export_dir=str(export_dir.resolve()),
            resume=str(resume) if resume else "",
            backends=parse_backends(backends),
            strict=strict,
            durable=durable,
            attempt=attempt,
        ),
    }


def open_job(
    *,
    trainers: int,
    rollouts: int,
    deadlines: Deadlines,
    host: str,
    port: int = 0,
    inject: str,
    steps: int,
    mirror_device: str,
    export_dir: Path,
    resume: tuple[int, Path] | None = None,
    store: str = "",
    backends: str = "",
    strict: bool = False,
    shared_domains: bool = True,
    durable: FloorConfig | None = None,
    previous: Coordinator | None = None,
) -> tuple[Coordinator, dict[str, str], Leadership | None]:
    """A launched job's coordinator and the environment its roles start with; the job's token
    is ``REPLICA_TOKEN`` or a fresh one. The job store is hosted by the coordinator on
    ``host:port``, or, with ``store`` (``etcd://HOSTS/NAMESPACE``), kept in etcd: then the
    coordinator leads by an election claim that fences its writes (the Leadership returned;
    resign it when the job ends) and the namespace must hold no other job
    (JobStoreInUseError). ``backends``: every role's ``Config.backends``, comma-separated ("":
    the default). ``strict``: a step that diverges after a failover ends the job.
    ``shared_domains``: a standby may share its trainer's failure domain (else the job fails,
    as set up wrong, when one joins there before the first commit). ``previous``: the coordinator
    of the job's attempt before (``roles/attempts.py``): the new one keeps its store, hosted or on
    etcd (and its leadership: None is returned), under the next attempt's prefix.
    ValueError for a bad ``store`` or an unknown backend; TransportError for a named backend
    that cannot work here (NIXL not installed, or without the plugin asked for)."""
    names = parse_backends(backends)  # refused before anything starts
    check_backends(names)
    backends = ",".join(names)
    if previous is not None:  # the same job's next attempt: its store, token and leadership kept
        coord, leadership = previous.next_attempt(resume_from=resume[0] if resume else None), None
        attempt, token = coord.attempt, coord.token.decode()
    else:
        attempt, token = 0, os.environ.get(envvars.TOKEN) or secrets.token_hex(16)
        address = StoreAddress.parse(store) if store else None
        if address is not None and address.kind != StoreKind.ETCD:
            raise ValueError(
                f"the job store {store!r}: a launcher hosts its own store (--host/--port) or keeps the "
                "job in etcd (etcd://HOSTS/NAMESPACE)"
            )
        leadership = lead_new_job(address, token.encode()) if address is not None else None
        try:
            coord = Coordinator(
                world_size=trainers,
                token=token.encode(),
                host=host,
                port=port,
                deadlines=deadlines,
                rollouts=rollouts,
                resume_from=resume[0] if resume else None,
                store=address,
                fence=leadership.claim if leadership is not None else None,
                shared_domains=shared_domains,
            )
        except BaseException:
            if leadership is not None:
                leadership.resign()
            raise
    env = role_env(
        store=coord.address,
        token=token,
        world_size=trainers,
        inject=inject,
        steps=steps,
        rollouts=rollouts,
        mirror_device=mirror_device,
        export_dir=export_dir,
        resume=resume[1] if resume else None,
        backends=backends,
        strict=strict,
        durable=durable,
        attempt=attempt,
    )
    return coord, env, leadership


class LocalAgent:
    """Starts the role processes on this machine and reports their exits."""

    def __init__(self, *, script: list[str], env: dict[str, str], replacements: int, exec_roles: bool = False):
        """``script``: the script and its arguments, run in every role. ``exec_roles``: each role
        a fresh interpreter (``python SCRIPT``), instead of a child of a server that imported
        torch once (``replica.processes``: started in milliseconds, not seconds)."""
        self._script = script
        self._env = env
        self._replacements = Replacements(replacements)
        self._exec_roles = exec_roles
        self.procs: dict[int, tuple[str, subprocess.Popen | ScriptProcess]] = {}
        self.spares: dict[int, int] = {}  # pid -> index of the spare standbys started here
        self._reported: set[int] = set()
        self._views: dict[int, ProcessView] = {}  # each process's last look (probe)

    def again(self, env: dict[str, str]) -> LocalAgent:
        """A fresh agent for the same script with ``env`` added to the roles' environment (the
        job's next attempt); this one's processes are its own (``kill_all``)."""
        return LocalAgent(
            script=self._script,
            env={**self._env, **env},
            replacements=self._replacements.left,
            exec_roles=self._exec_roles,
        )

    @property
    def env(self) -> dict[str, str]:
        """The environment every role starts with (before its role and rank)."""
        return dict(self._env)

    def kill_all(self, timeout: timedelta) -> None:
        """SIGKILL every role process still running and reap them (``timeout`` at most)."""
        for _, popen in self.procs.values():
            if popen.poll() is None:
                popen.kill()
        self.wait(timeout)

    def start(self, role: Role, rank: int, *, spare: int | None = None) -> int:
        """Start the role process of ``rank`` (a spare standby: ``spare``, its index, and no rank
        yet: ``roles/spares.py``); its pid."""
        env = {**self._env, **member_environ(role, rank, spare=spare)}
        if self._exec_roles:
            if threading.current_thread() is not threading.main_thread():
                # PR_SET_PDEATHSIG fires when the forking *thread* exits, not the launcher.
                raise MainThreadError("LocalAgent.start must be called from the main thread")
            popen = subprocess.Popen(die_with_launcher([sys.executable, *self._script]), env=env)
        else:
            popen = start_script(
                self._script, env=env, name=role_name(role, rank) if spare is None else f"spare {spare}"
            )
        self.procs[popen.pid] = (role, popen)
        if spare is not None:
            self.spares[popen.pid] = spare
        return popen.pid

    def start_spare(self, index: int) -> bool:
        self.start(Role.STANDBY, -1, spare=index)
        return True

    def spare_of(self, pid: int, host: str | None = None) -> int | None:
        return self.spares.get(pid) if host in (None, host_name()) else None

    def take_replacement(self) -> bool:
        return self._replacements.take()

    def exits(self) -> list[tuple[int, int, None]]:
        gone = []
        for pid, (_, popen) in self.procs.items():
            if pid not in self._reported and popen.poll() is not None:
                self._reported.add(pid)
                gone.append((pid, popen.returncode, None))
        return gone

    def replace_standby(self, rank: int) -> bool:
        return self._replace(Role.STANDBY, rank)

    def replace_rollout(self, index: int) -> bool:
        return self._replace(Role.ROLLOUT, index)

    def _replace(self, role: Role, rank: int) -> bool:
        if not self.take_replacement():
            return False
        self.start(role, rank)
        return True

    def kill(self, pid: int, host: str | None = None) -> None:
        """SIGKILL role process ``pid`` unless it has exited (a process declared dead may have
        exited meanwhile: then nothing)."""
        if pid in self.procs:
            self.procs[pid][1].kill()

    def silent_hosts(self, longer_than: timedelta) -> set[str]:
        return set()  # one machine: its processes' exits are seen at once

    def probe(self, pid: int, host: str | None = None) -> tuple[Verdict, str]:
        if pid not in self.procs or host not in (None, host_name()):
            return Verdict.UNKNOWN, ""
        return verdict_of(self._views, pid)

    def looks(self) -> list[tuple[int, Verdict, str]]:
        """(pid, verdict, why) of each role process whose exit was not reported yet, judged
        from this look at it and the last (what a host agent writes with its beats, for the
        coordinator's ``probe``). Reads ``/proc`` only: safe beside the thread that reaps."""
        return [
            (pid, *verdict_of(self._views, pid, min_gap_s=0.0)) for pid in list(self.procs) if pid not in self._reported
        ]

    def unaware_of_end(self) -> set[str]:
        return set()  # this agent is the coordinator's own process

    def running(self, pids: set[int]) -> bool:
        return any(self.procs[pid][1].poll() is None for pid in pids if pid in self.procs)

    def wait(self, timeout: timedelta) -> None:
        """Until every process started here exited by itself, ``timeout`` at most."""
        deadline = Deadline.after(timeout)
        for _, popen in self.procs.values():
            try:
                popen.wait(timeout=deadline.remaining_s())
            except subprocess.TimeoutExpired:
                return

    def stop(self) -> None:
        """Let standbys see the job's end and exit; kill whatever is left."""
        for _, popen in self.procs.values():
            if popen.poll() is None:
                try:
                    popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()

    def failed_codes(self, pids: set[int]) -> dict[int, int]:
        return {pid: code for pid in pids if pid in self.procs and (code := self.procs[pid][1].returncode)}


def start_roles(coord: Coordinator, agent, *, trainers: int, standbys: int, rollouts: int) -> None:
    """Start a job's roles through its agent (``start(role, rank)``): engines first (they start
    slowest), then standbys, then trainers; ranks without a standby are marked unprotected."""
    for rank in range(standbys, trainers):
        coord.set_unprotected(rank)
        print(f"replica: WARNING rank {rank} is UNPROTECTED: it has no standby", flush=True)
    for index in range(rollouts):
        agent.start(Role.ROLLOUT, index)
    for rank in range(standbys):
        agent.start(Role.STANDBY, rank)
    for rank in range(trainers):
        agent.start(Role.TRAINER, rank)
