"""``replica coordinator``: the coordinator alone, for a job whose roles run on
other machines (started there by hand, a scheduler or torchrun-style, with
``REPLICA_ROLE``, ``RANK``/``WORLD_SIZE`` and the store address). With no local
agent, deaths are found by transport reports and heartbeat deadlines, and a
rank whose standby was promoted or lost stays unprotected until a new standby
joins."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.errors import FencedError, JobStateError
from replica.jobstore import Attempt, JobStore, keys
from replica.jobstore.stores import StoreAddress, StoreKind
from replica.roles.argparsing import (
    Parser,
    deadline_options,
    deadlines_of,
    existing_file,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    resume_point,
    shared_domain_option,
    state_options,
    writable_file,
)
from replica.roles.attempts import announce, earlier_attempts, last_placement, place_on_agents
from replica.roles.coordinator import Coordinator
from replica.roles.election import Leadership
from replica.roles.env import configure_logging, durable_of, job_environ, parse_faults, shared_domains_allowed
from replica.roles.exits import ExitCode
from replica.roles.remote_agents import RemoteAgents
from replica.roles.served import first_placement, serve_job
from replica.roles.spares import SparePool
from replica.roles.supervise import JobSpec, supervise
from replica.session.backends import parse_backends
from replica.state.export import step_folder

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="replica coordinator", description=__doc__)
    p.add_argument("--world-size", type=positive_int, required=True, help="the number of trainer ranks")
    p.add_argument("--rollouts", type=non_negative_int, default=0, help="rollout engines that will join")
    p.add_argument("--steps", type=positive_int, required=True, help="the job's steps (for progress and the report)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="where the job store (TCP, --port) and the roles' liveness endpoint (UDP, a free port) "
        "listen; with --store etcd://... the liveness endpoint only (default loopback: a multi-node "
        "job binds a routable address, else roles on other hosts beat to the store)",
    )
    p.add_argument("--port", type=port, default=29400)
    p.add_argument(
        "--store",
        default="",
        help="keep the job's state in etcd instead of hosting a store: etcd://H1:2379,H2:2379,H3:2379/JOB "
        f"(credentials in {envvars.ETCD_USER}/{envvars.ETCD_PASSWORD}). Start this command on two "
        "or more hosts: one leads, the others take over when it dies",
    )
    p.add_argument(
        "--agents",
        type=non_negative_int,
        default=0,
        help="the number of hosts that run `replica agent` (indices 0 .. N-1): their exit reports are "
        "detection signals and they start replacements (default: none)",
    )
    p.add_argument(
        "--replacements",
        type=int,
        default=-1,
        help="replacement standbys or engines the agents may start in all (default: no limit)",
    )
    p.add_argument(
        "--spares",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="have the agents start N spare standbys ahead, bound to no rank, in failure domains without a "
        "trainer: a rank that loses its standby gets a ready spare instead of a new process, and trains "
        "on meanwhile; each spare bound is refilled as --replacements allows (needs --agents)",
    )
    p.add_argument(
        "--train-while-replacing",
        action="store_true",
        help="after a failover or a standby's death, train on unprotected while the rank's new standby "
        "starts (default: commit() waits until the rank is protected again)",
    )
    p.add_argument(
        "--standbys",
        type=non_negative_int,
        default=None,
        help="ranks 0..K-1 have standbys (default: all); the others are UNPROTECTED: their trainer's "
        "death ends the job",
    )
    p.add_argument(
        "--resume-step",
        type=non_negative_int,
        default=None,
        help="the trainers start from the script's own checkpoint of this step (they call "
        "job.restored(STEP)): it is the first commit. Not with --resume",
    )
    p.add_argument("--report", type=writable_file)
    p.add_argument("--timeline", type=writable_file)
    p.add_argument("--timeout", type=positive_float, default=3600)
    deadline_options(p)
    state_options(p)
    shared_domain_option(p)
    p.add_argument(
        "script",
        type=existing_file,
        nargs="?",
        help="serve this job to host agents started with `replica agent --serve` (--agents N): the "
        "script (at this path on every host) and its arguments, run in every role; the roles' "
        "settings are this command's (--steps, --rollouts, --export-dir, REPLICA_INJECT, "
        "REPLICA_DURABLE...) and every role is placed on the agents",
    )
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.spares and not args.agents:
        parser.error("--spares needs --agents: the host agents start the spares")
    if args.script and not args.agents:
        parser.error("a SCRIPT is served to host agents (`replica agent --serve`): give their number, --agents N")
    token = os.environ.get(envvars.TOKEN, "")
    if not token:
        parser.error(f"set {envvars.TOKEN} to the job's secret token (every role presents it when it joins)")
    try:
        deadlines = deadlines_of(args)
        durable = durable_of(os.environ) is not None
    except ValueError as exc:
        parser.error(str(exc))
    point = resume_point(parser, args, args.world_size)
    # The step and the folder its trainers resume from (RESUME; "": their own checkpoint, --resume-step).
    resume = (point[0], str(point[1])) if point is not None else None
    standbys = args.world_size if args.standbys is None else args.standbys
    if not 0 <= standbys <= args.world_size:
        parser.error(f"need 0 <= --standbys <= --world-size, got {standbys}")
    if args.resume_step is not None:
        if resume is not None or args.resume_step < 0:
            parser.error("--resume-step takes a step >= 0 and does not go with --resume")
        resume = (args.resume_step, "")
    try:
        store = StoreAddress.parse(args.store) if args.store else None
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging()
    leadership, attempt = None, 0
    if store is not None and store.kind == StoreKind.ETCD:
        leadership = Leadership(JobStore(store.connect(timeout=timedelta(seconds=60)), token=token.encode()))
        print(f"replica: coordinator candidate ({leadership.name}) for the job in {store}", flush=True)
        job = leadership.candidate

        def ended() -> bool:  # the attempt in progress finished (one that went back to the floor did too)
            current = job.get(keys.attempt())
            return job.attempt(current.number if current is not None else 0).has(keys.finished())

        if not leadership.campaign(timeout=timedelta(seconds=args.timeout), give_up=ended):
            print("replica: the job ended under another coordinator", flush=True)
            return ExitCode.OK
        print("replica: this coordinator leads", flush=True)
        if (current := job.get(keys.attempt())) is not None:  # the job went back to its floor before
            attempt, resume = current.number, (current.step, str(step_folder(current.directory, current.step)))
    try:
        coord = Coordinator(
            world_size=args.world_size,
            token=token.encode(),
            host=args.host,
            port=args.port,
            deadlines=deadlines,
            rollouts=args.rollouts,
            resume_from=resume[0] if resume else None,
            store=store,
            fence=leadership.claim if leadership is not None else None,
            shared_domains=shared_domains_allowed(args.allow_shared_domain),
            attempt=attempt,
        )
        _unprotect(coord, standbys, args.world_size)
        return _serve(args, coord, resume, leadership, durable=durable and args.agents > 0, standbys=standbys)
    except FencedError as exc:
        print(f"replica: another coordinator leads now ({exc}); this one stops", flush=True)
        return ExitCode.DEPOSED
    finally:
        if leadership is not None:
            leadership.resign()


def _unprotect(coord: Coordinator, standbys: int, world_size: int) -> None:
    if coord.takeover is None:
        for rank in range(standbys, world_size):
            coord.set_unprotected(rank)
            print(f"replica: WARNING rank {rank} is UNPROTECTED: it has no standby", flush=True)


def _serve(
    args: argparse.Namespace,
    coord: Coordinator,
    resume: tuple[int, str] | None,
    leadership: Leadership | None,
    *,
    durable: bool,
    standbys: int,
) -> int:
    """Supervise the job; with a durable floor and host agents, each return to the floor starts
    the next attempt in place (roles/attempts.py) until the job ends."""
    if coord.takeover is not None:
        print(f"replica: took over the job at generation {coord.generation}, commit {coord.record.last()}", flush=True)
    print(f"replica: coordinator of {args.world_size} trainer ranks at {coord.address}", flush=True)
    if resume and resume[1]:
        print(
            f"replica: resuming from step {resume[0]}: start the trainers with {envvars.RESUME}={resume[1]}", flush=True
        )
    elif resume:
        print(f"replica: resuming from step {resume[0]}: the trainers restore it from their own checkpoint", flush=True)
    timeline = args.timeline or (args.report.with_suffix(".png") if args.report else None)
    # The roles read REPLICA_INJECT themselves; the coordinator only reports when those faults fired.
    faults = parse_faults(os.environ.get(envvars.INJECT, ""))
    base = JobStore(coord.store.raw, token=coord.token)  # the job's own prefix: the attempt in progress
    current = base.get(keys.attempt())  # None: the first attempt
    placement: tuple[dict, set[int]] | None = None  # the attempt before's roles, its agents still alive
    if args.script and coord.takeover is None and coord.attempt == 0:  # a job served to `replica agent --serve`
        job = serve_job(base, script=Path(args.script), args=args.script_args, environ=_served_environ(args, resume))
        print(f"replica: the job {job.id} ({job.script}) is served to {args.agents} host agents", flush=True)
        placement = (
            first_placement(world_size=args.world_size, standbys=standbys, rollouts=args.rollouts),
            set(range(args.agents)),
        )
    while True:
        # The attempts that went back to the floor, from the store (this coordinator may have taken the job
        # over in a later attempt): their entries and records for the report, and the faults that fired in
        # them (not injected again).
        restarts, earlier = earlier_attempts(
            base, coord.attempt, world_size=args.world_size, steps=args.steps, faults=[str(f) for f in faults]
        )
        fired = set(current.fired) if current is not None else set()
        agents = (
            RemoteAgents(
                coord.store,
                count=args.agents,
                replacements=args.replacements,
                members=coord.members_for_placement,
                trainers=args.world_size,
            )
            if args.agents
            else None
        )
        if placement is not None and agents is not None:
            unplaced = place_on_agents(agents, placement[0], expected=placement[1], shared_domains=coord.shared_domains)
            if unplaced:
                print(
                    "replica: the job failed: no live host agent can run "
                    + ", ".join(f"{role} {rank}" for role, rank in unplaced)
                    + " in its next attempt",
                    flush=True,
                )
                coord.finish()
                return ExitCode.FAILED
        # Placed as the agents come up. A coordinator that took the job over starts none (the first one's
        # are up or bound) and binds none (it does not know them): it only knows a free one's exit for one.
        spares = (
            SparePool(coord.store, 0 if coord.takeover is not None else args.spares, agents)
            if agents is not None and args.spares
            else None
        )

        def next_attempt(step: int, coord: Coordinator = coord, fired: set[str] = fired) -> None:
            version = coord.store.get(keys.floor_version(step))
            announce(
                base,
                Attempt(
                    number=coord.attempt + 1,
                    step=step,
                    directory=version.directory if version else "",
                    fired=tuple(sorted(fired | {str(f) for f in faults if coord.fired(str(f))})),
                    reason=coord.failure or "",
                ),
            )

        remaining = tuple(f for f in faults if str(f) not in fired)
        status = supervise(
            coord,
            JobSpec(
                steps=args.steps,
                faults=remaining,
                timeout=timedelta(seconds=args.timeout),
                report=args.report,
                timeline_png=timeline,
                export_dir=args.export_dir,
                train_while_replacing=args.train_while_replacing,
                first_step=resume[0] + 1 if resume else 1,
                durable=durable,
                restarts=tuple(restarts),
                earlier=tuple(earlier),
                next_attempt=next_attempt if durable else None,
            ),
            agents,
            leading=leadership.leading if leadership is not None else None,
            spares=spares,
        )
        if status != ExitCode.RESUME:
            return status
        current = base.get(keys.attempt())
        if current is None:  # next_attempt announced it before supervise returned
            raise JobStateError("the job's next attempt has no (verified) record in the job store")
        assert agents is not None  # a return to the floor needs host agents (durable is False without them)
        placement = (last_placement(coord.members, standbys=standbys), {info.index for info in agents.live()})
        resume = (current.step, str(step_folder(current.directory, current.step)))
        print(
            f"replica: attempt {current.number} of the job starts from the durable floor's version of step "
            f"{current.step}",
            flush=True,
        )
        previous, coord = coord, coord.next_attempt(resume_from=current.step)
        previous.close()
        _unprotect(coord, standbys, args.world_size)


def _served_environ(args: argparse.Namespace, resume: tuple[int, str] | None) -> dict[str, str]:
    """The settings of a served job's roles: this command's, as ``replica launch`` gives its own."""
    return job_environ(
        store="",
        token="",
        world_size=args.world_size,
        steps=args.steps,
        inject=os.environ.get(envvars.INJECT, ""),
        rollouts=args.rollouts,
        mirror_device=os.environ.get(envvars.MIRROR_DEVICE, ""),
        export_dir=str(args.export_dir.resolve()),
        resume=resume[1] if resume else "",
        backends=parse_backends(os.environ.get(envvars.BACKENDS, "")),
        strict=bool(os.environ.get(envvars.STRICT)),
        durable=durable_of(os.environ),
    )


if __name__ == "__main__":
    sys.exit(main())
