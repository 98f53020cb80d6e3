"""``replica launch``: coordinator + N trainers + N standbys as local processes
running one user script, with fault injection, a progress line, the failover
timeline (table, JSON, PNG) and a JSON report of every rank's per-step losses
(exact floats). Every role process dies with the launcher, even a launcher
killed with SIGKILL."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Protocol, TextIO

from replica import envvars
from replica.errors import JobStateError, ReplicaError
from replica.jobstore import keys
from replica.processes import start_server
from replica.roles.argparsing import (
    Parser,
    deadline_options,
    deadlines_of,
    durable_of_args,
    durable_options,
    existing_file,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    resume_point,
    shared_domain_option,
    start_options,
    state_options,
    writable_file,
)
from replica.roles.attempts import ended_attempt
from replica.roles.coordinator import Coordinator, MemberState
from replica.roles.election import Leadership
from replica.roles.env import (
    DEFAULT_STEPS,
    HOST,
    Fault,
    Role,
    check_faults,
    configure_logging,
    domain_name,
    parse_faults,
    shared_domains_allowed,
)
from replica.roles.exits import ExitCode
from replica.roles.local_agent import LocalAgent, open_job, start_roles
from replica.roles.spares import SpareHost, SparePool
from replica.roles.supervise import Agent, JobSpec, supervise
from replica.session.backends import BACKENDS
from replica.state.export import step_folder

__all__ = ["LaunchAgent", "StatusLines", "main"]


class LaunchAgent(Agent, SpareHost, Protocol):
    """What starts and watches the roles of ``replica launch``: its ``LocalAgent``, or with
    ``--ray`` the agent ``ray_agents`` makes (``replica.ray.RayAgents``)."""

    def start(self, role: Role, rank: int) -> object:
        """Start the process of role ``role`` of ``rank`` (``start_roles``)."""
        ...

    def stop(self) -> None:
        """Let the roles see the job's end and exit; kill whatever is left."""
        ...

    def failed_codes(self, pids: set[int]) -> dict[int, int]:
        """The nonzero exit codes of those of ``pids`` that exited."""
        ...


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


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="replica launch", description=__doc__)
    p.add_argument("script", type=existing_file, help="the training script; it runs in every role")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.add_argument("--trainers", type=positive_int, default=2)
    p.add_argument(
        "--rollouts",
        type=non_negative_int,
        default=0,
        help="rollout engines (the script serves them: see docs/weight-sync.md)",
    )
    p.add_argument(
        "--standbys",
        type=non_negative_int,
        default=None,
        help="standbys to start, for ranks 0..K-1 (default: one per trainer); the others are unprotected",
    )
    p.add_argument(
        "--replacements",
        type=int,
        default=-1,
        help="new standbys the launcher may start for promoted or dead ones (default: no limit)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULT_STEPS,
        help=f"the job's step count: the script's job.env.steps ({envvars.STEPS})",
    )
    p.add_argument(
        "--inject",
        default="",
        help="kill:trainer:RANK@STEP[:PHASE][:gGEN],kill:standby:RANK@STEP,"
        "kill:rollout:INDEX@STEP (while generating for STEP),"
        "freeze:trainer:RANK@STEP[:PHASE] (SIGSTOP), "
        "stall:trainer:RANK@STEP[:SECONDS], corrupt:standby:RANK@STEP "
        "(its durable part of STEP; --durable) (PHASE: forward, backward, "
        "reduce-scatter, optimizer, mirror, commit)",
    )
    p.add_argument(
        "--spares",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="start N spare standbys ahead, bound to no rank: a rank that loses its standby (a promotion, "
        "its death) gets a ready spare instead of a new process, and trains on meanwhile; each spare "
        "bound is refilled as --replacements allows (docs/failover.md)",
    )
    p.add_argument(
        "--train-while-replacing",
        action="store_true",
        help="after a failover, train on unprotected while the rank's new standby starts (default: "
        "commit() waits until the rank is protected again)",
    )
    p.add_argument(
        "--mirror-device",
        choices=("model", "cpu"),
        default="model",
        help="where standbys hold their mirrors: on their model's device (a GPU model: GPU memory, "
        "CUDA IPC within a node; promotion is one unpack) or in pinned host memory (GPU memory "
        "stays free for the standby's rollouts; promotion copies the state to the GPU)",
    )
    p.add_argument(
        "--backends",
        default="",
        help="the transports of every role's data plane, comma-separated, in order of preference "
        f"(of {', '.join(BACKENDS)}; default: replica.Config's, ipc,shm,ucx,nixl,gloo: CUDA IPC and "
        "shared memory within a node, UCX across nodes); e.g. ucx,gloo keeps host memory on UCX",
    )
    p.add_argument("--report", type=writable_file, help="write the job report (losses, faults, timeline) as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="end the job (non-zero exit) when a step redone after a failover does not reproduce its loss "
        "or state (the divergence guard; without it the divergence is logged and reported)",
    )
    p.add_argument(
        "--timeline", type=writable_file, help="plot the failover timeline as PNG (default: beside --report)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="where the job store listens (on a Ray cluster of several machines: the driver's routable address)",
    )
    p.add_argument(
        "--ray",
        default="",
        metavar="ADDRESS",
        help="run every role as a Ray actor on the cluster at ADDRESS ('auto': the one this machine "
        "belongs to; needs replica[ray]); standby r is placed on rollout r's node unless that is in "
        "trainer r's failure domain",
    )
    p.add_argument(
        "--ray-placement",
        default="",
        metavar="JSON",
        help='Ray resources per role and the spread, e.g. \'{"trainer": {"GPU": 8}, "rollout": {"GPU": 8}, '
        '"standby": {"CPU": 1}, "strategy": "STRICT_SPREAD", "timeout_s": 60, '
        '"start_timeout_s": 180, "domain_label": "rack"}\' (default: 1 CPU each, each trainer and '
        "rollout machine on its own node; timeout_s: for the placement group, start_timeout_s: for each "
        "role's actor to start; domain_label: the Ray node label that names a failure domain, default: "
        "each node)",
    )
    p.add_argument("--port", type=port, default=0, help="the job store's port (default: any free one)")
    p.add_argument(
        "--store",
        default="",
        metavar="etcd://H1:2379,H2:2379,H3:2379/JOB",
        help="keep the job's state in etcd instead of hosting a store (credentials in "
        f"{envvars.ETCD_USER}/{envvars.ETCD_PASSWORD}, {envvars.ETCD_CA}: the roles read them too); "
        "the namespace must hold no other job",
    )
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds before the whole job is abandoned")
    deadline_options(p)
    state_options(p)
    durable_options(p)
    shared_domain_option(p)
    start_options(p)
    return p


def main(argv: list[str] | None = None, *, ray_agents: Callable[..., LaunchAgent] | None = None) -> int:
    """``replica launch``; ``ray_agents`` (the `replica` command passes replica.ray's) makes the
    agent of ``--ray``."""
    parser = _parser()
    args = parser.parse_args(argv)
    standbys = args.trainers if args.standbys is None else args.standbys
    if standbys > args.trainers:
        parser.error(f"--standbys {standbys}: at most one standby per trainer (--trainers {args.trainers})")
    resume = resume_point(parser, args, args.trainers)
    shared = shared_domains_allowed(args.allow_shared_domain)
    durable = durable_of_args(parser, args)
    if standbys and not args.ray and not shared:
        parser.error(
            f"every role of `replica launch` runs on this machine (failure domain {domain_name()!r}): the "
            "standby of rank 0 would share its trainer's domain, and losing the machine would lose both "
            "copies of its state. Place standbys on other machines (`replica agent`, --ray), or pass "
            "--allow-shared-domain (one-machine demos and tests)"
        )
    try:
        faults = parse_faults(args.inject)
        if any(f.role == HOST for f in faults):
            raise ValueError("host faults need host agents (`replica agent`): `replica launch` runs on one machine")
        check_faults(
            faults,
            trainers=args.trainers,
            standbys=standbys,
            rollouts=args.rollouts,
            first_step=resume[0] + 1 if resume else 1,
            last_step=args.steps,
            durable=durable is not None,
        )
        deadlines = deadlines_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not (args.ray or args.exec_roles):
        start_server()  # a fork of this process, before the store's threads: the roles start from its imports
    configure_logging()
    # A job that fails before its first global commit starts again from its start: once, or
    # --replacements N times (0: never). Nothing was committed, so nothing is lost; the faults
    # that fired are not injected again. A rank that lost every in-memory copy goes back to the
    # floor's newest version (--durable): all roles start again from it. Either way the job's next
    # attempt keeps this store (hosted on its --port, or etcd) under a prefix of its own
    # (roles/attempts.py): nothing of the attempt before is read again.
    allowed = 1 if args.replacements < 0 else args.replacements
    restarts: list[dict] = []
    earlier: list[dict] = []  # the reports of attempts that went back to the durable floor
    coord: Coordinator | None = None
    leadership: Leadership | None = None
    try:
        while True:
            try:
                following, env, led = open_job(
                    trainers=args.trainers,
                    rollouts=args.rollouts,
                    deadlines=deadlines,
                    host=args.host,
                    port=args.port,
                    inject=",".join(map(str, faults)),
                    steps=args.steps,
                    mirror_device=args.mirror_device,
                    export_dir=args.export_dir,
                    resume=resume,
                    store=args.store,
                    backends=args.backends,
                    strict=args.strict,
                    shared_domains=shared,
                    durable=durable,
                    previous=coord,
                )
            except ValueError as exc:
                parser.error(str(exc))
            except ReplicaError as exc:
                print(f"replica: {exc}", flush=True)
                return ExitCode.USAGE
            if coord is not None:
                coord.close()
            coord, leadership = following, leadership or led
            status = _run(
                args,
                coord,
                env,
                standbys=standbys,
                faults=faults,
                resume=resume,
                ray_agents=ray_agents,
                leading=leadership.leading if leadership is not None else None,
                restarts_left=allowed - len(restarts),
                restarts=tuple(restarts),
                durable=durable is not None,
                earlier=tuple(earlier),
            )
            if status not in (ExitCode.RESTART, ExitCode.RESUME):
                return status
            fired = [f for f in faults if coord.fired(str(f)) is not None]
            entry = {"reason": coord.failure, "faults_fired": [str(f) for f in fired]}
            if status == ExitCode.RESUME:
                assert durable is not None  # supervise goes back to the floor only in a job that has one
                latest = coord.store.get(keys.floor_latest())
                if latest is None:  # supervise recorded the version every role starts again from
                    raise JobStateError("the durable floor's latest version has no (verified) record in the job store")
                version = latest.value
                entry, report = ended_attempt(
                    coord.store,
                    world_size=coord.world_size,
                    steps=args.steps,
                    faults=[str(f) for f in faults],
                    version=version,
                    reason=coord.failure,
                )
                earlier.insert(0, report)
                resume = (version, step_folder(durable.directory, version))
            restarts.append(entry)
            faults = tuple(f for f in faults if f not in fired)
    finally:
        if coord is not None:
            coord.close()
        if leadership is not None:
            leadership.resign()


def _run(
    args: argparse.Namespace,
    coord: Coordinator,
    env: dict[str, str],
    *,
    standbys: int,
    faults: tuple[Fault, ...],
    resume: tuple[int, Path] | None,
    ray_agents: Callable[..., LaunchAgent] | None,
    leading: Callable[[], bool] | None,
    restarts_left: int,
    restarts: tuple[dict, ...],
    durable: bool,
    earlier: tuple[dict, ...],
) -> int:
    print(
        f"replica: job store at {coord.address}; {args.trainers} trainers, {standbys} standbys, "
        f"{args.rollouts} rollouts" + (f"; resuming from step {resume[0]} in {resume[1]}" if resume else ""),
        flush=True,
    )
    script = [args.script, *args.script_args]
    if args.ray:
        if ray_agents is None:
            print("replica: --ray: run this through the `replica` command (it needs replica[ray])", flush=True)
            return ExitCode.USAGE
        try:
            agent = ray_agents(
                address=args.ray,
                placement=args.ray_placement,
                script=script,
                env=env,
                replacements=args.replacements,
                trainers=args.trainers,
                rollouts=args.rollouts,
                standbys=standbys,
                members=coord.members_for_placement,
                shared_domains=coord.shared_domains,
            )
        except (ReplicaError, ValueError) as exc:
            print(f"replica: {exc}", flush=True)
            return ExitCode.USAGE
    else:
        agent = LocalAgent(script=script, env=env, replacements=args.replacements, exec_roles=args.exec_roles)
    try:
        start_roles(coord, agent, trainers=args.trainers, standbys=standbys, rollouts=args.rollouts)
        spares = SparePool(coord.store, args.spares, agent) if args.spares else None
        timeline = args.timeline or (args.report.with_suffix(".png") if args.report else None)
        spec = JobSpec(
            steps=args.steps,
            faults=faults,
            timeout=timedelta(seconds=args.timeout),
            report=args.report,
            timeline_png=timeline,
            train_while_replacing=args.train_while_replacing,
            export_dir=args.export_dir,
            first_step=resume[0] + 1 if resume else 1,
            restarts_left=restarts_left,
            restarts=restarts,
            durable=durable,
            earlier=earlier,
        )
        with contextlib.redirect_stdout(StatusLines(sys.stdout)):
            status = supervise(coord, spec, agent, leading=leading, spares=spares)
    finally:
        agent.stop()
    codes = agent.failed_codes({m.pid for m in coord.members if m.role == Role.TRAINER and m.state == MemberState.DONE})
    if status == ExitCode.OK and codes:
        print(f"replica: trainers finished but exited with codes {codes}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
