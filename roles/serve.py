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

from replica.roles.coordinator import Coordinator
from replica.roles.env import configure_logging, parse_faults
from replica.roles.launch import deadline_options, deadlines_of, resume_point, state_options
from replica.roles.supervise import JobSpec, supervise

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replica coordinator", description=__doc__)
    p.add_argument("--world-size", type=int, required=True, help="the number of trainer ranks")
    p.add_argument("--rollouts", type=int, default=0, help="rollout engines that will join")
    p.add_argument("--steps", type=int, required=True, help="the job's steps (for progress and the report)")
    p.add_argument("--host", default="127.0.0.1",
                   help="where the job store listens (default loopback; a multi-node job binds a routable address)")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--report", type=Path)
    p.add_argument("--timeline", type=Path)
    p.add_argument("--timeout", type=float, default=3600)
    deadline_options(p)
    state_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    token = os.environ.get("REPLICA_TOKEN", "")
    if not token:
        parser.error("set REPLICA_TOKEN to the job's secret token (every role presents it when it joins)")
    try:
        deadlines = deadlines_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    resume = resume_point(parser, args, args.world_size)
    configure_logging()
    coord = Coordinator(world_size=args.world_size, token=token.encode(), host=args.host, port=args.port,
                        deadlines=deadlines, rollouts=args.rollouts, resume_from=resume[0] if resume else None)
    print(f"replica: coordinator of {args.world_size} trainer ranks at {coord.address}", flush=True)
    if resume:
        print(f"replica: resuming from step {resume[0]}: start the trainers with REPLICA_RESUME={resume[1]}",
              flush=True)
    timeline = args.timeline or (args.report.with_suffix(".png") if args.report else None)
    # The roles read REPLICA_INJECT themselves; the coordinator only reports when those faults fired.
    faults = parse_faults(os.environ.get("REPLICA_INJECT", ""))
    return supervise(coord, JobSpec(steps=args.steps, faults=faults, timeout=timedelta(seconds=args.timeout), report=args.report,
                                    timeline_png=timeline, export_dir=args.export_dir,
                                    first_step=resume[0] + 1 if resume else 1))


if __name__ == "__main__":
    sys.exit(main())
