"""The ``replica`` command: ``replica launch [options] SCRIPT [ARGS...]``."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: replica launch [--trainers N] [--steps N] [--inject SPEC] [--report PATH] SCRIPT [ARGS...]
       replica coordinator --world-size N --steps N [--host H] [--port P] [--report PATH]
       replica compare REFERENCE.json OTHER.json
(each command's --help lists its options)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "launch":
        from replica.roles.launch import main as launch

        return launch(argv[1:])
    if argv[0] == "coordinator":
        from replica.roles.serve import main as coordinator

        return coordinator(argv[1:])
    if argv[0] == "compare" and len(argv) == 3:
        return _compare(*argv[1:])
    print(f"replica: bad command {' '.join(argv)!r}\n{_USAGE}", file=sys.stderr)
    return 2


def _compare(reference: str, other: str) -> int:
    from replica.roles.report import compare_reports, load_report

    a, b = load_report(reference), load_report(other)
    problems = compare_reports(a, b)
    for line in problems[:20]:
        print(f"replica: {line}")
    if problems:
        print(f"replica: {len(problems)} losses differ from the reference")
        return 1
    rewards = [float.fromhex(m["reward"]) for m in b.get("metrics_hex", {}).get("0", []) if m and "reward" in m]
    if len(rewards) >= 10:
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(f"replica: mean reward {first:.3f} over the first 5 steps, {last:.3f} over the last 5 "
              f"({'rising' if last > first else 'NOT rising'})")
    fired = [f["fault"] for f in b.get("faults", []) if f.get("fired_at")]
    print(f"replica: the loss trajectory of all {a['trainers']} ranks over {a['steps']} steps equals the "
          f"reference bit for bit (faults fired: {', '.join(fired) or 'none'}; "
          f"failovers: {len(b.get('failovers', []))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
