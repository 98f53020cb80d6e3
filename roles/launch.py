"""``replica launch``: coordinator + N trainers + N standbys as local processes
running one user script, with fault injection, a progress line, the failover
timeline and a JSON report of every rank's per-step losses (exact floats)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from replica.roles.coordinator import Coordinator
from replica.roles.env import parse_faults

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replica launch", description=__doc__)
    p.add_argument("script", help="the training script; it runs in every role")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="passed to the script as REPLICA_STEPS")
    p.add_argument("--inject", default="", help="kill:trainer:RANK@STEP[:PHASE],... (PHASE: forward, backward, "
                                                "optimizer, mirror, commit)")
    p.add_argument("--report", type=Path, help="write the job report (losses, faults, timeline) as JSON")
    p.add_argument("--host", default="127.0.0.1", help="where the job store listens")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the whole job is abandoned")
    p.add_argument("--heartbeat-deadline", type=float, default=10.0,
                   help="seconds without a heartbeat before a live but silent process is declared dead "
                        "(a process that exits is declared dead at once)")
    return p


class _Proc:
    def __init__(self, role: str, rank: int, popen: subprocess.Popen):
        self.role, self.rank, self.popen = role, rank, popen


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        faults = parse_faults(args.inject)
    except ValueError as exc:
        parser.error(str(exc))
    token = os.environ.get("REPLICA_TOKEN") or secrets.token_hex(16)
    coord = Coordinator(world_size=args.trainers, host=args.host,
                        heartbeat_deadline=timedelta(seconds=args.heartbeat_deadline))

    def start(role: str, rank: int) -> _Proc:
        # Lazy gloo connections: a generation's group is built in ~1 ms and connects at its
        # first collective, instead of waiting out gloo's connect back-off (measured: ~150 ms
        # off every failover here). Set TORCH_GLOO_LAZY_INIT=0 to opt out.
        env = dict({"TORCH_GLOO_LAZY_INIT": "1"}, **os.environ)
        env = dict(env, REPLICA_ROLE=role, REPLICA_RANK=str(rank), REPLICA_WORLD_SIZE=str(args.trainers),
                   REPLICA_STORE=coord.address, REPLICA_TOKEN=token, REPLICA_INJECT=args.inject,
                   REPLICA_STEPS=str(args.steps))
        return _Proc(role, rank, subprocess.Popen([sys.executable, args.script, *args.script_args], env=env))

    procs = [start("standby", r) for r in range(args.trainers)] + [start("trainer", r) for r in range(args.trainers)]
    trainers = {p.rank: p for p in procs if p.role == "trainer"}
    standbys = {p.rank: p for p in procs if p.role == "standby"}
    deadline = time.monotonic() + args.timeout
    shown = 0
    status = 1
    try:
        while time.monotonic() < deadline:
            for rank, proc in list(trainers.items()):
                if coord.store.check([f"replica/done/{rank}"]):
                    continue  # finished its steps: how it exits is no failover
                code = proc.popen.poll()
                stale = code is None and coord.stale(proc.popen.pid)
                if (code is not None and code != 0) or stale:
                    if stale:
                        proc.popen.kill()
                    reason = "heartbeat missed" if stale else f"exit code {code}"
                    if rank not in standbys:
                        print(f"\nreplica: trainer {rank} died ({reason}) and has no standby: job failed", flush=True)
                        return 1
                    coord.fail_trainer(rank, reason)
                    trainers[rank] = standbys.pop(rank)
                    standbys[rank] = start("standby", rank)  # the rank is protected again once it is up
                    procs.append(standbys[rank])
            for rank, proc in list(standbys.items()):
                code = proc.popen.poll()
                if code is not None and not coord.store.check(["replica/finished"]):
                    print(f"\nreplica: standby {rank} died (exit code {code}); rank {rank} is unprotected "
                          "until its replacement is up", flush=True)
                    coord.standby_lost(rank, f"exit code {code}")
                    standbys[rank] = start("standby", rank)
                    procs.append(standbys[rank])
            done = [r for r in range(args.trainers) if coord.store.check([f"replica/done/{r}"])]
            step = _last_step(coord, args.steps, shown)
            if step > shown:
                shown = step
                print(f"\rreplica: step {shown}/{args.steps}  commit {coord.record.last()}  "
                      f"generation {coord.generation}  failovers {len(coord.failovers)}", end="", flush=True)
            if len(done) == args.trainers and all(p.popen.poll() is not None for p in trainers.values()):
                status = 0
                codes = {r: p.popen.returncode for r, p in trainers.items() if p.popen.returncode}
                if codes:
                    print(f"\nreplica: trainers finished but exited with codes {codes}", flush=True)
                break
            time.sleep(0.02)
        else:
            print(f"\nreplica: job did not finish within {args.timeout} s", flush=True)
        print(flush=True)
        coord.store.set("replica/finished", "1")
        for failover in coord.failovers:
            coord.observe(failover, [str(f) for f in faults])
        report = _report(coord, args, faults)
        _print_timeline(coord)
        if args.report:
            args.report.write_text(json.dumps(report, indent=2) + "\n")
            print(f"replica: report written to {args.report}")
        return status
    finally:
        for p in procs:
            if p.popen.poll() is None:
                try:
                    p.popen.wait(timeout=5 if p.role == "standby" else 0.1)
                except subprocess.TimeoutExpired:
                    p.popen.kill()


def _last_step(coord: Coordinator, total: int, shown: int) -> int:
    step = shown
    while step < total and coord.store.check([f"replica/loss/0/{step + 1}"]):
        step += 1
    return step


def _report(coord: Coordinator, args, faults) -> dict:
    losses, times = {}, {}
    for rank in range(args.trainers):
        keys = [f"replica/loss/{rank}/{s}" for s in range(1, args.steps + 1)]
        logged = [coord.store.get(k).decode().split(" ") if coord.store.check([k]) else (None, None) for k in keys]
        losses[str(rank)] = [loss for loss, _ in logged]
        times[str(rank)] = [float(at) if at is not None else None for _, at in logged]
    return {
        "steps": args.steps,
        "step_end_times": times,
        "trainers": args.trainers,
        "losses_hex": losses,
        "faults": [{"fault": str(f), "fired_at": coord.fired(str(f))} for f in faults],
        "failovers": [asdict(f) for f in coord.failovers],
        "standbys_replaced": coord.standbys_replaced,
        "last_commit": coord.record.last(),
    }


def _print_timeline(coord: Coordinator) -> None:
    if not coord.failovers:
        return
    print("failover timeline (ms after the kill):")
    print("| rank | generation | commit | detect | promote | reconnect | resumed |")
    print("|---|---|---|---|---|---|---|")
    for f in coord.failovers:
        t = f.timeline_ms
        cells = [f"{t[k]:.0f}" if k in t else "-" for k in ("detect", "promote", "reconnect", "resumed")]
        print(f"| {f.rank} | {f.generation} | {f.commit} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
