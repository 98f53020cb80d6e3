"""``replica launch``: coordinator + N trainers + N standbys as local processes
running one user script, with fault injection, a progress line, the failover
timeline (table, JSON, PNG) and a JSON report of every rank's per-step losses
(exact floats). Every role process dies with the launcher, even a launcher
killed with SIGKILL."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import TextIO

from replica.session.backends import BACKENDS, parse_backends
from replica.errors import ReplicaError
from replica.state.export import resumable
from replica.roles.coordinator import Coordinator, MemberState
from replica.roles.election import Leadership, lead_new_job
from replica.roles.argparsing import (
    Parser,
    existing_file,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    writable_file,
)
from replica.roles.env import HOST, Role, check_faults, configure_logging, parse_faults
from replica.roles.supervise import JobSpec, supervise
from replica.roles.timing import Deadlines
from replica.jobstore.stores import StoreAddress, StoreKind
from replica.timing import Deadline

__all__ = ["LocalAgent", "StatusLines", "deadline_options", "deadlines_of", "die_with_launcher", "main", "open_job",
           "resume_point", "role_env", "start_roles", "state_options"]

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


class StatusLines:
    """The launcher's stdout. Role processes write to the same terminal at any time, so
    a status line redrawn in place (a write starting with ``\\r``, as the progress line)
    would run into their output: each becomes a line of its own instead, at most one
    every ``every_s`` seconds, and the latest one is shown before any other output.
    A newline that would end a line already ended (the writer's way to close its
    status line) is dropped."""

    def __init__(self, out: TextIO, *, every_s: float = 5.0):
        self._out = out
        self._every_s = every_s
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._shown: str | None = None
        self._shown_at = float("-inf")
        self._line_ended = True

    def write(self, text: str) -> int:
        with self._lock:
            if text.startswith("\r") and "\n" not in text:
                self._pending = text.lstrip("\r")
                if time.monotonic() - self._shown_at >= self._every_s:
                    self._show()
                return len(text)
            if not text:  # print(..., end="") writes its empty end: not output
                return 0
            self._show()
            out = text[1:] if self._line_ended and text.startswith("\n") else text
            if out:
                self._out.write(out)
                self._line_ended = out.endswith("\n")
            return len(text)

    def _show(self) -> None:
        if self._pending is not None and self._pending != self._shown:
            self._out.write(self._pending + "\n")
            self._shown, self._shown_at = self._pending, time.monotonic()
            self._line_ended = True
        self._pending = None

    def flush(self) -> None:
        self._out.flush()

    def __getattr__(self, name: str):
        return getattr(self._out, name)


def deadline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-deadline", type=positive_float, default=Deadlines().trainer.total_seconds(),
                   help="seconds without a heartbeat before a live but silent trainer is declared dead "
                        "(a process that exits is declared dead at once)")
    p.add_argument("--standby-deadline", type=positive_float, default=None,
                   help="the same for standbys (default: --heartbeat-deadline)")


def state_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--export-dir", type=Path, default=Path("replica-export"),
                   help="where the standbys write the last commit when the job cannot go on (a rank's state lost; "
                        "the job store gone), one folder per step (default: ./replica-export)")
    p.add_argument("--resume", type=Path, default=None,
                   help="start from an export: a folder with one file per rank (Mirror.export), or a job's export "
                        "folder (its newest step of which every rank's file is there)")


def resume_point(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> tuple[int, Path] | None:
    """The step and folder ``--resume`` names (None without it); a parser error if it holds no complete export."""
    if args.resume is None:
        return None
    try:
        step, folder = resumable(args.resume, world_size)
    except ReplicaError as exc:
        parser.error(f"--resume: {exc}")
    return step, folder.resolve()


def deadlines_of(args: argparse.Namespace) -> Deadlines:
    trainer = timedelta(seconds=args.heartbeat_deadline)
    return Deadlines(trainer=trainer, standby=timedelta(seconds=args.standby_deadline) if args.standby_deadline
                     else trainer)


def role_env(*, store: str, token: str, world_size: int, inject: str, steps: int, rollouts: int, mirror_device: str,
             export_dir: Path, resume: Path | None, backends: str = "", strict: bool = False) -> dict[str, str]:
    """The environment every role of a launched job starts with (this one's, plus the job's)."""
    # Lazy gloo connections: a generation's group is built in ~1 ms and connects at its
    # first collective, instead of waiting out gloo's connect back-off (measured: ~150 ms
    # off every failover here). Set TORCH_GLOO_LAZY_INIT=0 to opt out.
    # UCX prints an error line of its own when an endpoint to a killed peer is closed
    # ("error during flush: Connection reset by remote peer"): replica reports and handles every
    # peer death itself. UCX_LOG_LEVEL=error (or any level) set by the user is kept.
    env = dict({"TORCH_GLOO_LAZY_INIT": "1", "UCX_LOG_LEVEL": "fatal"}, **os.environ)
    env.update(REPLICA_WORLD_SIZE=str(world_size), REPLICA_STORE=store, REPLICA_TOKEN=token,
               REPLICA_INJECT=inject, REPLICA_STEPS=str(steps), REPLICA_ROLLOUTS=str(rollouts),
               REPLICA_MIRROR_DEVICE="" if mirror_device == "model" else mirror_device,
               REPLICA_EXPORT_DIR=str(export_dir.resolve()), REPLICA_RESUME=str(resume) if resume else "",
               REPLICA_BACKENDS=backends, REPLICA_STRICT="1" if strict else "")
    return env


def open_job(*, trainers: int, rollouts: int, deadlines: Deadlines, host: str, port: int = 0, inject: str, steps: int,
             mirror_device: str, export_dir: Path, resume: tuple[int, Path] | None = None, store: str = "",
             backends: str = "", strict: bool = False) -> tuple[Coordinator, dict[str, str], Leadership | None]:
    """A launched job's coordinator and the environment its roles start with; the job's token
    is ``REPLICA_TOKEN`` or a fresh one. The job store is hosted by the coordinator on
    ``host:port``, or, with ``store`` (``etcd://HOSTS/NAMESPACE``), kept in etcd: then the
    coordinator leads by an election claim that fences its writes (the Leadership returned;
    resign it when the job ends) and the namespace must hold no other job
    (JobStoreInUseError). ``backends``: every role's ``Config.backends``, comma-separated ("":
    the default). ``strict``: a step that diverges after a failover ends the job.
    ValueError for a bad ``store`` or an unknown backend."""
    backends = ",".join(parse_backends(backends))  # refused before anything starts
    token = os.environ.get("REPLICA_TOKEN") or secrets.token_hex(16)
    address = StoreAddress.parse(store) if store else None
    if address is not None and address.kind != StoreKind.ETCD:
        raise ValueError(f"the job store {store!r}: a launcher hosts its own store (--host/--port) or keeps the job "
                         "in etcd (etcd://HOSTS/NAMESPACE)")
    leadership = lead_new_job(address, token.encode()) if address is not None else None
    try:
        coord = Coordinator(world_size=trainers, token=token.encode(), host=host, port=port, deadlines=deadlines,
                            rollouts=rollouts, resume_from=resume[0] if resume else None, store=address,
                            fence=leadership.claim if leadership is not None else None)
    except BaseException:
        if leadership is not None:
            leadership.resign()
        raise
    env = role_env(store=coord.address, token=token, world_size=trainers, inject=inject, steps=steps,
                   rollouts=rollouts, mirror_device=mirror_device, export_dir=export_dir,
                   resume=resume[1] if resume else None, backends=backends, strict=strict)
    return coord, env, leadership


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="replica launch", description=__doc__)
    p.add_argument("script", type=existing_file, help="the training script; it runs in every role")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.add_argument("--trainers", type=positive_int, default=2)
    p.add_argument("--rollouts", type=non_negative_int, default=0,
                   help="rollout engines (the script serves them: see README)")
    p.add_argument("--standbys", type=non_negative_int, default=None,
                   help="standbys to start, for ranks 0..K-1 (default: one per trainer); the others are unprotected")
    p.add_argument("--replacements", type=int, default=-1,
                   help="new standbys the launcher may start for promoted or dead ones (default: no limit)")
    p.add_argument("--steps", type=positive_int, default=20, help="passed to the script as REPLICA_STEPS")
    p.add_argument("--inject", default="", help="kill:trainer:RANK@STEP[:PHASE][:gGEN],kill:standby:RANK@STEP,"
                                                "kill:rollout:INDEX@STEP (while generating for STEP),"
                                                "freeze:trainer:RANK@STEP[:PHASE] (SIGSTOP), "
                                                "stall:trainer:RANK@STEP[:SECONDS] (PHASE: forward, backward, "
                                                "reduce-scatter, optimizer, mirror, commit)")
    p.add_argument("--train-while-replacing", action="store_true",
                   help="after a failover, train on unprotected while the rank's new standby starts (default: "
                        "commit() waits until the rank is protected again)")
    p.add_argument("--mirror-device", choices=("model", "cpu"), default="model",
                   help="where standbys hold their mirrors: on their model's device (a GPU model: GPU memory, "
                        "CUDA IPC within a node; promotion is one unpack) or in pinned host memory (GPU memory "
                        "stays free for the standby's rollouts; promotion copies the state to the GPU)")
    p.add_argument("--backends", default="",
                   help="the transports of every role's data plane, comma-separated, in order of preference "
                        f"(of {', '.join(BACKENDS)}; default: replica.Config's, ipc,shm,ucx,gloo: CUDA IPC and "
                        "shared memory within a node, UCX across nodes); e.g. ucx,gloo keeps host memory on UCX")
    p.add_argument("--report", type=writable_file, help="write the job report (losses, faults, timeline) as JSON")
    p.add_argument("--strict", action="store_true",
                   help="end the job (non-zero exit) when a step redone after a failover does not reproduce its loss "
                        "or state (the divergence guard; without it the divergence is logged and reported)")
    p.add_argument("--timeline", type=writable_file,
                   help="plot the failover timeline as PNG (default: beside --report)")
    p.add_argument("--host", default="127.0.0.1",
                   help="where the job store listens (on a Ray cluster of several machines: the driver's routable "
                        "address)")
    p.add_argument("--ray", default="", metavar="ADDRESS",
                   help="run every role as a Ray actor on the cluster at ADDRESS ('auto': the one this machine "
                        "belongs to; needs replica[ray]); standby r is placed on rollout r's node")
    p.add_argument("--ray-placement", default="", metavar="JSON",
                   help='Ray resources per role and the spread, e.g. \'{"trainer": {"GPU": 8}, "rollout": {"GPU": 8}, '
                        '"standby": {"CPU": 1}, "strategy": "STRICT_SPREAD", "timeout_s": 60, '
                        '"start_timeout_s": 180}\' (default: 1 CPU each, each trainer and rollout machine on its own '
                        'node; timeout_s: for the placement group, start_timeout_s: for each role\'s actor to start)')
    p.add_argument("--port", type=port, default=0, help="the job store's port (default: any free one)")
    p.add_argument("--store", default="", metavar="etcd://H1:2379,H2:2379,H3:2379/JOB",
                   help="keep the job's state in etcd instead of hosting a store (credentials in "
                        "REPLICA_ETCD_USER/REPLICA_ETCD_PASSWORD, REPLICA_ETCD_CA: the roles read them too); the "
                        "namespace must hold no other job")
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds before the whole job is abandoned")
    deadline_options(p)
    state_options(p)
    return p


class LocalAgent:
    """Starts the role processes on this machine and reports their exits."""

    def __init__(self, *, script: list[str], env: dict[str, str], replacements: int):
        self._script = script
        self._env = env
        self._replacements = replacements
        self.procs: dict[int, tuple[str, subprocess.Popen]] = {}
        self._reported: set[int] = set()

    def start(self, role: str, rank: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the forking *thread* exits, not the launcher.
            raise RuntimeError("LocalAgent.start must be called from the main thread")
        env = dict(self._env, REPLICA_ROLE=role, REPLICA_RANK=str(rank))
        popen = subprocess.Popen(die_with_launcher([sys.executable, *self._script]), env=env)
        self.procs[popen.pid] = (role, popen)
        return popen.pid

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

    def _replace(self, role: str, rank: int) -> bool:
        if self._replacements == 0:
            return False
        self._replacements -= 1
        self.start(role, rank)
        return True

    def kill(self, pid: int, host: str | None = None) -> None:
        if pid in self.procs and self.procs[pid][1].poll() is None:
            os.kill(pid, signal.SIGKILL)

    def silent_hosts(self, longer_than: timedelta) -> set[str]:
        return set()  # one machine: its processes' exits are seen at once

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
        return {pid: self.procs[pid][1].returncode for pid in pids if pid in self.procs and
                self.procs[pid][1].returncode}


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


def main(argv: list[str] | None = None, *, ray_agents: Callable[..., object] | None = None) -> int:
    """``replica launch``; ``ray_agents`` (the `replica` command passes replica.ray's) makes the
    agent of ``--ray``."""
    parser = _parser()
    args = parser.parse_args(argv)
    standbys = args.trainers if args.standbys is None else args.standbys
    if standbys > args.trainers:
        parser.error(f"--standbys {standbys}: at most one standby per trainer (--trainers {args.trainers})")
    resume = resume_point(parser, args, args.trainers)
    try:
        faults = parse_faults(args.inject)
        if any(f.role == HOST for f in faults):
            raise ValueError("host faults need host agents (`replica agent`): `replica launch` runs on one machine")
        check_faults(faults, trainers=args.trainers, standbys=standbys, rollouts=args.rollouts,
                     first_step=resume[0] + 1 if resume else 1, last_step=args.steps)
        deadlines = deadlines_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging()
    try:
        coord, env, leadership = open_job(
            trainers=args.trainers, rollouts=args.rollouts, deadlines=deadlines, host=args.host, port=args.port,
            inject=args.inject, steps=args.steps, mirror_device=args.mirror_device, export_dir=args.export_dir,
            resume=resume, store=args.store, backends=args.backends, strict=args.strict)
    except ValueError as exc:
        parser.error(str(exc))
    except ReplicaError as exc:
        print(f"replica: {exc}", flush=True)
        return 2
    try:
        return _run(args, coord, env, standbys=standbys, faults=faults, resume=resume, ray_agents=ray_agents,
                    leading=leadership.leading if leadership is not None else None)
    finally:
        if leadership is not None:
            leadership.resign()


def _run(args: argparse.Namespace, coord: Coordinator, env: dict[str, str], *, standbys: int, faults: list,
         resume: tuple[int, Path] | None, ray_agents: Callable[..., object] | None,
         leading: Callable[[], bool] | None) -> int:
    print(f"replica: job store at {coord.address}; {args.trainers} trainers, {standbys} standbys, "
          f"{args.rollouts} rollouts" + (f"; resuming from step {resume[0]} in {resume[1]}" if resume else ""),
          flush=True)
    script = [args.script, *args.script_args]
    if args.ray:
        if ray_agents is None:
            print("replica: --ray: run this through the `replica` command (it needs replica[ray])", flush=True)
            return 2
        try:
            agent = ray_agents(address=args.ray, placement=args.ray_placement, script=script, env=env,
                               replacements=args.replacements, trainers=args.trainers, rollouts=args.rollouts,
                               standbys=standbys, members=coord.members_for_placement)
        except (ReplicaError, ValueError) as exc:
            print(f"replica: {exc}", flush=True)
            return 2
    else:
        agent = LocalAgent(script=script, env=env, replacements=args.replacements)
    try:
        start_roles(coord, agent, trainers=args.trainers, standbys=standbys, rollouts=args.rollouts)
        timeline = args.timeline or (args.report.with_suffix(".png") if args.report else None)
        spec = JobSpec(steps=args.steps, faults=faults, timeout=timedelta(seconds=args.timeout), report=args.report,
                       timeline_png=timeline, train_while_replacing=args.train_while_replacing,
                       export_dir=args.export_dir, first_step=resume[0] + 1 if resume else 1)
        with contextlib.redirect_stdout(StatusLines(sys.stdout)):
            status = supervise(coord, spec, agent, leading=leading)
    finally:
        agent.stop()
    codes = agent.failed_codes({m.pid for m in coord.members if m.role == Role.TRAINER and m.state == MemberState.DONE})
    if status == 0 and codes:
        print(f"replica: trainers finished but exited with codes {codes}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
