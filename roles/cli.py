"""The ``replica`` command: ``replica launch [options] SCRIPT [ARGS...]``."""

from __future__ import annotations

import sys

from replica.roles.exits import ExitCode

__all__ = ["main"]

_USAGE = """usage: replica launch [--trainers N] [--steps N] [--inject SPEC] [--report PATH] [--ray ADDRESS]
                      SCRIPT [ARGS...]
       replica coordinator --world-size N --steps N [--host H] [--port P] [--store etcd://...] [--agents N]
       replica agent --store ADDRESS --index N [--address A] [--roles ROLE:RANK,...] SCRIPT [ARGS...]
       replica compare REFERENCE.json OTHER.json [--plot LOSSES.png]
       replica selftest [--quick] [--device cpu|cuda] [--trainers N] [--ray ADDRESS] [--report DIR]
(each command's --help lists its options)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return ExitCode.OK if argv else ExitCode.USAGE
    if argv[0] == "launch":
        from replica.roles.launch import main as launch

        return launch(argv[1:], ray_agents=_ray_agents)
    if argv[0] == "coordinator":
        from replica.roles.serve import main as coordinator

        return coordinator(argv[1:])
    if argv[0] == "agent":
        from replica.roles.host_agent import main as agent

        return agent(argv[1:])
    if argv[0] == "selftest":
        from replica.roles.selftest import main as selftest

        return selftest(argv[1:])
    if argv[0] == "compare":
        return _compare(argv[1:])
    print(f"replica: bad command {' '.join(argv)!r}\n{_USAGE}", file=sys.stderr)
    return ExitCode.USAGE


def _ray_agents(**kwargs):
    """``replica launch --ray``'s agent; replica.ray is imported only then (the ray extra)."""
    try:
        from replica.ray.launch import ray_agents
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray: pip install 'replica[ray]' ({exc})") from exc
    return ray_agents(**kwargs)


def _compare(argv: list[str]) -> int:
    from pathlib import Path

    from replica.roles.argparsing import Parser, existing_file, writable_file
    from replica.roles.report import compare_reports, load_report, write_loss_png

    parser = Parser(
        prog="replica compare", description="compare two job reports' per-step losses (and metrics) exactly"
    )
    parser.add_argument("reference", type=existing_file, help="the report of the failure-free run")
    parser.add_argument("other", type=existing_file, help="the report of the run to check (with faults)")
    parser.add_argument("--plot", type=writable_file, help="also plot both runs' loss curves, faults marked, as PNG")
    args = parser.parse_args(argv)
    try:
        a, b = load_report(args.reference), load_report(args.other)
    except (OSError, ValueError) as exc:  # not JSON, not a report, unreadable
        parser.error(str(exc).splitlines()[0])
    if args.plot is not None and write_loss_png(
        a, b, args.plot, names=(Path(args.reference).stem, Path(args.other).stem)
    ):
        print(f"replica: loss curves plotted in {args.plot}")
    problems = compare_reports(a, b)
    for line in problems[:20]:
        print(f"replica: {line}")
    if problems:
        print(f"replica: {len(problems)} losses differ from the reference")
        return ExitCode.FAILED
    rewards = [float.fromhex(m["reward"]) for m in b.get("metrics_hex", {}).get("0", []) if m and "reward" in m]
    if len(rewards) >= 10:
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(
            f"replica: mean reward {first:.3f} over the first 5 steps, {last:.3f} over the last 5 "
            f"({'rising' if last > first else 'NOT rising'})"
        )
    fired = [f["fault"] for f in b.get("faults", []) if f.get("fired_at")]
    print(
        f"replica: the loss trajectory of all {a['trainers']} ranks over {a['steps']} steps equals the "
        f"reference bit for bit (faults fired: {', '.join(fired) or 'none'}; "
        f"failovers: {len(b.get('failovers', []))})"
    )
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
