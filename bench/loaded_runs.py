"""A real job killed at a random step and phase, run again and again beside a load: does any
healthy role get declared dead, and is every run bit-identical to the failure-free one?

    python bench/loaded_runs.py --runs 50 --beside "../shared/tools/stall 3600"

Each run is ``replica launch --trainers 2 --steps STEPS --inject kill:trainer:R@S:PHASE``
of ``examples/train_hf.py --loader plain --workers 2`` (a Hugging Face model under FSDP2, a
plain DataLoader whose two workers are forked again at every epoch: one every 6 steps), R, S
and PHASE drawn from ``--seed``. A failure-free run of the same job, beside the same load,
is the reference. ``--beside`` starts a load command for the whole run (killed at the end).

A false death is a failover of a rank no fault killed, a second failover of the killed one,
or a standby replaced (no standby is killed). Prints a line a run and a summary, and writes
every run's facts as JSON (``--out``). Exit status 1 when a run failed, diverged or had a
false death."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replica.roles.env import PHASES
from replica.roles.report import compare_reports

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_hf.py"
SCRIPT_ARGS = ("--loader", "plain", "--workers", "2")


def _launch(folder: Path, name: str, steps: int, timeout_s: float, *options: str) -> tuple[int, dict | None, str]:
    report = folder / f"{name}.json"
    command = [
        sys.executable,
        "-m",
        "replica.roles.cli",
        "launch",
        "--allow-shared-domain",
        "--trainers",
        "2",
        "--steps",
        str(steps),
        "--timeout",
        str(timeout_s),
        "--report",
        str(report),
        "--export-dir",
        str(folder / f"{name}-export"),
        *options,
        str(SCRIPT),
        *SCRIPT_ARGS,
    ]
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 60)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = -1, f"timed out after {timeout_s + 60} s: {exc.stdout!r}"
    return code, json.loads(report.read_text()) if report.exists() else None, output


def _facts(code: int, report: dict | None, reference: dict, killed: int) -> dict:
    if report is None:
        return {"code": code, "bit_identical": False, "false_deaths": [], "suspected_stalls": 0, "restarts": 0}
    failovers = report.get("failovers", [])
    false = [f"failover of rank {f['rank']}: {f['reason']}" for f in failovers if f["rank"] != killed]
    false += [
        f"failover of rank {f['rank']} again: {f['reason']}" for f in [f for f in failovers if f["rank"] == killed][1:]
    ]
    false += [f"standby replaced: {s}" for s in report.get("standbys_replaced", [])]
    return {
        "code": code,
        "bit_identical": compare_reports(reference, report) == [],
        "false_deaths": false,
        "failovers": len(failovers),
        "suspected_stalls": len(report.get("suspected_stalls", [])),
        "restarts": len(report.get("restarts", [])),
        "faults_fired": [f["fault"] for f in report.get("faults", []) if f.get("fired_at") is not None],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/loaded_runs.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beside", default="", help="a load command to run meanwhile, e.g. '../shared/tools/stall 3600'")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one run")
    p.add_argument("--out", type=Path, default=None, help="write every run's facts here as JSON")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 3:
        p.error("need --runs >= 1 and --steps >= 3")
    rng = random.Random(args.seed)
    load = (
        subprocess.Popen(
            shlex.split(args.beside), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if args.beside
        else None
    )
    runs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="loaded-runs-") as tmp:
            folder = Path(tmp)
            code, reference, output = _launch(folder, "reference", args.steps, args.timeout)
            if code != 0 or reference is None:
                print(f"the failure-free run failed ({code}):\n{output[-4000:]}", file=sys.stderr)
                return 1
            print(
                f"reference: {len(reference['failovers'])} failovers, "
                f"{len(reference.get('suspected_stalls', []))} suspected stalls",
                flush=True,
            )
            for index in range(args.runs):
                rank, step, phase = rng.randrange(2), rng.randrange(1, args.steps), rng.choice(PHASES)
                fault = f"kill:trainer:{rank}@{step}:{phase}"
                started = time.monotonic()
                code, report, output = _launch(folder, f"run{index}", args.steps, args.timeout, "--inject", fault)
                facts = {
                    "run": index,
                    "fault": fault,
                    "seconds": round(time.monotonic() - started, 1),
                    **_facts(code, report, reference, rank),
                }
                runs.append(facts)
                bad = code != 0 or not facts["bit_identical"] or facts["false_deaths"]
                print(
                    f"run {index + 1}/{args.runs} {fault}: exit {code}, "
                    f"{'bit-identical' if facts['bit_identical'] else 'DIFFERS'}, "
                    f"false deaths {len(facts['false_deaths'])}, suspected stalls {facts['suspected_stalls']}, "
                    f"restarts {facts['restarts']}, {facts['seconds']} s",
                    flush=True,
                )
                if bad:
                    print(output[-3000:], file=sys.stderr, flush=True)
    finally:
        if load is not None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait()
    summary = {
        "runs": len(runs),
        "failed": sum(r["code"] != 0 for r in runs),
        "not_bit_identical": sum(not r["bit_identical"] for r in runs),
        "false_deaths": sum(len(r["false_deaths"]) for r in runs),
        "suspected_stalls": sum(r["suspected_stalls"] for r in runs),
        "restarts": sum(r["restarts"] for r in runs),
        "beside": args.beside,
        "seed": args.seed,
    }
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 1 if summary["failed"] or summary["not_bit_identical"] or summary["false_deaths"] else 0


if __name__ == "__main__":
    sys.exit(main())
