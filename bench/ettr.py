"""ETTR under random failures: replica against checkpoint-restart (``make ettr``).

The RL loop (examples/rl_loop.py: vLLM rollouts, FSDP2 GRPO trainers) runs on a
network-namespace cluster (tests/support/cluster.py) of six hosts: the coordinator's
(host 0, never failed), two trainer hosts (1, 2) and three rollout hosts (3-5)
with one vLLM engine each and, for replica, the standbys (of rank 0 on host 3, of
rank 1 on host 4). A `replica agent` on each worker host starts its roles.

Failures arrive as a Poisson process (bench/ettr_model.py: a fixed seed, the
schedule recorded) over trainers, standbys, rollouts and whole hosts, at each
mean time between failures (in failure-free step times), from the end of step 1:

* replica: a process is SIGKILLed (the agent reports it); a host is lost whole
  (its link cut, then everything on it killed: only deadlines find it) and comes
  back ``--reboot`` seconds later with its agent and no roles. replica fails over,
  replaces standbys and engines, and goes on. Were the job lost (a rank's last
  copy gone), it would start again from the standbys' export (`--resume`).
* checkpoint_restart, what users run today: the same job without standbys, saving
  a torch.distributed.checkpoint every K steps (K: the best one for that failure
  rate by the measured step, save and restart times; bench/ettr_model.py). Any
  failure of one of its processes or hosts restarts every role (at once: detection
  is free for it), which load the newest checkpoint and replay. A lost host must
  be back before the restart. A standby failure has nothing to hit.

A run that has not finished by ``--cap`` x its failure-free time is stopped and
measured as it stands. Writes bench/results/ettr.json (ETTR per rate for both,
the details of every run, the schedules) and ettr.png, and prints a table and a
256-GPU projection (a model from the parts measured here, labelled as one).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]  # its modules; the tests' helpers (support)

from bench_results import RESULTS_DIR, machine  # noqa: E402
from ettr_model import Failure, Target, best_interval, figures, poisson_schedule, step_time  # noqa: E402
from ettr_projection import projection  # noqa: E402

from replica import envvars  # noqa: E402
from replica.errors import ReplicaError  # noqa: E402
from replica.state.export import resumable  # noqa: E402
from support import cluster as testcluster  # noqa: E402
from support.cluster import ClusterConfig, NetnsCluster  # noqa: E402

__all__ = ["main"]

SCRIPT = ROOT / "examples" / "rl_loop.py"
PROBE = ROOT / "bench" / "store_probe.py"
STORE_PORT = 29400
WORKERS = 5  # hosts 1..5 run agents 0..4
FLOOR_EVERY = 10  # replica's durable floor: a version every this many steps (--durable-every)
PLACEMENT = {
    "replica": ("trainer:0", "trainer:1", "standby:0,rollout:0", "standby:1,rollout:1", "rollout:2"),
    "checkpoint_restart": ("trainer:0", "trainer:1", "rollout:0", "rollout:1", "rollout:2"),
}
SYSTEMS = tuple(PLACEMENT)


class Progress:
    """One status line, rewritten in place (a new line per run)."""

    def __init__(self, title: str, steps: int):
        self.title, self.steps, self.started = title, steps, time.monotonic()

    def show(self, step: int | None, faults: int, note: str = "") -> None:
        done = step or 0
        bar = "#" * (24 * done // self.steps)
        print(
            f"\r  {self.title:<34} [{bar:<24}] step {done:>3}/{self.steps}  faults {faults:>2}  "
            f"{time.monotonic() - self.started:6.0f} s  {note:<28}",
            end="",
            flush=True,
        )

    def end(self, text: str) -> None:
        self.show(self.steps, 0)
        print(f"\r  {self.title:<34} {text}{' ' * 60}", flush=True)


class Attempt:
    """One launch of the job on the cluster: `replica coordinator` on host 0, an agent on
    each worker host, a probe of the job store beside the coordinator."""

    def __init__(
        self,
        cluster: NetnsCluster,
        folder: Path,
        *,
        system: str,
        steps: int,
        token: str,
        number: int,
        resume_step: int | None = None,
        resume_export: Path | None = None,
        checkpoint_every: int = 0,
        down: set[int] = frozenset(),
        train_while_replacing: bool = False,
    ):
        self.cluster, self.folder, self.system, self.number = cluster, folder, system, number
        self.report = folder / f"attempt{number}.json"
        self.launched_at = time.time()
        coord = cluster.hosts[0]
        self.store = f"{coord.address}:{STORE_PORT}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(envvars.PREFIX)}
        self.env.update(
            {
                envvars.TOKEN: token,
                envvars.TORCH_WORLD_SIZE: "2",
                envvars.STEPS: str(steps),
                envvars.ROLLOUTS: "3",
                envvars.EXPORT_DIR: str(folder / "export"),
                envvars.GLOO_LAZY_INIT: "1",
                "GLOO_SOCKET_IFNAME": "eth0",
                envvars.UCX_LOG_LEVEL: "fatal",
                "PYTHONPATH": str(ROOT),
            }
        )
        if resume_export is not None:
            self.env[envvars.RESUME] = str(resume_export)
        self.script = [str(SCRIPT)]
        options = ["--agents", str(WORKERS)]
        if system == "checkpoint_restart":
            self.script += [
                "--checkpoint-dir",
                str(folder / "checkpoints"),
                "--checkpoint-every",
                str(checkpoint_every),
            ]
            options += ["--standbys", "0", "--replacements", "0"]
            if resume_step is not None:
                options += ["--resume-step", str(resume_step)]
        else:
            options += ["--train-while-replacing"] if train_while_replacing else []
            options += ["--resume", str(resume_export)] if resume_export is not None else []
            # The durable floor: what a pair loss (a rank's trainer and standby) goes back to. `replica
            # coordinator` ends such a job (in-process resumes are `replica launch`'s): the next attempt
            # starts from the newest of the floor and the export.
            self.env.update(
                {
                    envvars.DURABLE: str(folder / "floor"),
                    envvars.DURABLE_EVERY: str(FLOOR_EVERY),
                    envvars.DURABLE_INTERVAL: "0",
                }
            )
        self.procs: dict[str, subprocess.Popen] = {}
        self._start(
            "coordinator",
            0,
            [
                "-m",
                "replica.roles.cli",
                "coordinator",
                "--world-size",
                "2",
                "--steps",
                str(steps),
                "--rollouts",
                "3",
                "--host",
                coord.address,
                "--port",
                str(STORE_PORT),
                "--timeout",
                "3600",
                "--report",
                str(self.report),
                "--export-dir",
                str(folder / "export"),
                *options,
            ],
        )
        self.probe = coord.popen(
            [sys.executable, str(PROBE), self.store, "120"],
            env=self.env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._answer() != "ready":
            raise RuntimeError(f"the job store of attempt {number} did not come up:\n{self.output('coordinator')}")
        for index, roles in enumerate(PLACEMENT[system]):
            if index + 1 not in down:
                self.start_agent(index + 1, roles)

    def start_agent(self, host: int, roles: str = "") -> None:
        address = self.cluster.hosts[host].address
        self._start(
            f"agent{host - 1}",
            host,
            [
                "-m",
                "replica.roles.cli",
                "agent",
                "--store",
                self.store,
                "--index",
                str(host - 1),
                "--address",
                address,
                "--roles",
                roles,
                *self.script,
            ],
        )

    def _start(self, name: str, host: int, args: list[str]) -> None:
        with open(self.folder / f"a{self.number}-{name}.log", "a") as log:
            self.procs[name] = self.cluster.hosts[host].popen(
                [sys.executable, *args], env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )

    def output(self, name: str) -> str:
        path = self.folder / f"a{self.number}-{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _answer(self):
        line = self.probe.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, query: str):
        """The probe's answer (None once the store is gone)."""
        if self.probe.poll() is not None:
            return None
        try:
            self.probe.stdin.write(query + "\n")
            self.probe.stdin.flush()
            return self._answer()
        except (OSError, ValueError):
            return None

    def members(self) -> list[dict]:
        return self.ask("members") or []

    def pid_of(self, role: str, rank: int) -> int | None:
        alive = [m for m in self.members() if m["role"] == role and m["rank"] == rank and m["state"] != "dead"]
        return alive[-1]["pid"] if alive else None

    def losses(self, steps: int) -> dict[int, dict]:
        """Every logged step of this attempt: {step: {"losses": [per rank], "metrics": [...], "at": t}}."""
        answer = self.ask(f"losses {steps}")
        return {int(s): v for s, v in answer.items()} if isinstance(answer, dict) else {}

    def exited(self) -> int | None:
        return self.procs["coordinator"].poll()

    def stop(self) -> None:
        """Everything of this attempt, on every host, dies now (a job restart)."""
        for host in self.cluster.hosts:
            host.kill()
        for proc in (*self.procs.values(), self.probe):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def logged_steps(report: dict) -> dict[int, dict]:
    """A finished attempt's report in the probe's ``losses`` shape."""
    out = {}
    ranks = sorted(report["losses_hex"], key=int)
    for i in range(report["steps"]):
        losses = [report["losses_hex"][r][i] for r in ranks]
        if all(v is not None for v in losses):
            out[i + 1] = {
                "losses": losses,
                "metrics": [report["metrics_hex"][r][i] for r in ranks],
                "at": report["step_end_times"]["0"][i],
            }
    return out


@dataclass(kw_only=True)
class Run:
    """One system's run at one failure rate, over as many attempts as it took."""

    system: str
    mtbf_steps: float | None
    schedule: list[Failure]
    checkpoint_every: int = 0
    steps: dict[int, dict] = field(default_factory=dict)  # the final model's steps (later attempts replace)
    attempts: int = 0
    injected: list[dict] = field(default_factory=list)  # each failure: what it hit (or "nothing")
    interruptions: list[float] = field(default_factory=list)  # when training was stopped or rolled back
    steps_redone: int = 0
    failovers: int = 0
    job_restarts: int = 0
    launched_at: float = 0.0  # its first attempt's launch
    clock_start: float = 0.0
    stopped_at: float = 0.0
    reports: list[dict] = field(default_factory=list)


class Bench:
    def __init__(
        self, cluster: NetnsCluster, work: Path, *, steps: int, reboot_s: float, cap: float, train_while_replacing: bool
    ):
        self.cluster, self.work, self.steps, self.reboot_s, self.cap = cluster, work, steps, reboot_s, cap
        self.train_while_replacing = train_while_replacing
        self.token = secrets.token_hex(16)

    def run(
        self,
        system: str,
        *,
        mtbf_steps: float | None,
        schedule: list[Failure],
        checkpoint_every: int = 0,
        limit_s: float = 3600.0,
        title: str = "",
    ) -> Run:
        run = Run(system=system, mtbf_steps=mtbf_steps, schedule=schedule, checkpoint_every=checkpoint_every)
        folder = self.folder(run)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        progress = Progress(title or f"{system} mtbf={mtbf_steps}", self.steps)
        down: dict[int, float] = {}  # host -> when it is back
        pending = list(schedule)
        attempt = self._launch(run, folder, down=set())
        launched = time.monotonic()
        restart_due = False
        try:
            while True:
                now = time.time()
                commit = attempt.ask("commit") if attempt is not None else None
                if run.clock_start == 0.0 and commit is not None and commit >= 1:
                    run.clock_start = attempt.losses(1).get(1, {}).get("at") or now
                    schedule_base = run.clock_start
                progress.show(
                    commit,
                    len(run.injected),
                    f"attempt {run.attempts}" + (f", hosts down {sorted(down)}" if down else ""),
                )
                for host, back in list(down.items()):  # a lost host is back (rebooted, link up)
                    if now >= back:
                        self.cluster.hosts[host].heal()
                        del down[host]
                        if attempt is not None and system == "replica":
                            attempt.start_agent(host)
                if attempt is not None and (code := attempt.exited()) is not None:
                    self._collect(run, attempt, finished=True)
                    if code == 0 and all(s in run.steps for s in range(1, self.steps + 1)):
                        run.stopped_at = run.steps[self.steps]["at"]
                        break
                    attempt.stop()
                    attempt, restart_due = None, True
                    run.job_restarts += 1
                    run.interruptions.append(now)
                if restart_due and not down:
                    attempt = self._launch(run, folder, down=set(down))
                    restart_due = False
                if run.clock_start and pending and now >= schedule_base + pending[0].at_s:
                    failure = pending.pop(0)
                    hit = self._inject(run, attempt, failure, down, now)
                    run.injected.append({"failure": str(failure), "hit": hit, "at": now})
                    if hit and system == "checkpoint_restart":  # every role restarts, from the newest checkpoint
                        if attempt is not None:
                            self._collect(run, attempt, finished=False)
                            attempt.stop()
                            attempt = None
                        restart_due = True
                        run.job_restarts += 1
                    if hit:
                        run.interruptions.append(now)
                if time.monotonic() - launched > limit_s:
                    run.stopped_at = time.time()
                    if attempt is not None:
                        self._collect(run, attempt, finished=False)
                    break
                time.sleep(0.2)
        finally:
            if attempt is not None:
                attempt.stop()
            for host in down:
                self.cluster.hosts[host].heal()
        progress.end(
            f"{len(run.steps)}/{self.steps} steps, {len(run.injected)} faults, "
            f"{run.job_restarts} restarts, {run.attempts} attempts"
        )
        return run

    def folder(self, run: Run) -> Path:
        return self.work / f"{run.system}-{run.mtbf_steps or 'none'}-k{run.checkpoint_every}"

    def saves(self, run: Run) -> dict[int, float]:
        """How long each of a run's checkpoint saves took (after that step), by rank 0's measure."""
        folder = self.folder(run) / "checkpoints"
        done = [p / ".done" for p in folder.glob("*") if p.name.isdigit()] if folder.exists() else []
        return {int(d.parent.name): float(d.read_text()) for d in done if d.exists()}

    def _launch(self, run: Run, folder: Path, *, down: set[int]) -> Attempt:
        run.attempts += 1
        run.launched_at = run.launched_at or time.time()
        resume_step = resume_export = None
        if run.system == "checkpoint_restart":
            done = [
                int(p.name) for p in (folder / "checkpoints").glob("*") if p.name.isdigit() and (p / ".done").exists()
            ]
            resume_step = max(done, default=None)
            if run.attempts > 1:
                run.steps_redone += max(0, max(run.steps, default=0) - (resume_step or 0))
        elif run.attempts > 1:
            step = 0  # nothing exported, nothing on the floor: from the start
            for where in (folder / "export", folder / "floor"):  # the newest of the two
                try:
                    found, path = resumable(where, 2)
                except ReplicaError:
                    continue
                if found > step:
                    step, resume_export = found, path
            run.steps_redone += max(0, max(run.steps, default=0) - step)
        return Attempt(
            self.cluster,
            folder,
            system=run.system,
            steps=self.steps,
            token=self.token,
            number=run.attempts,
            resume_step=resume_step,
            resume_export=resume_export,
            checkpoint_every=run.checkpoint_every,
            down=down,
            train_while_replacing=self.train_while_replacing,
        )

    def _collect(self, run: Run, attempt: Attempt, *, finished: bool) -> None:
        """Take what an attempt logged into the run (its steps replace earlier attempts')."""
        if finished and attempt.report.exists():
            report = json.loads(attempt.report.read_text())
            run.reports.append(
                {
                    k: report[k]
                    for k in ("failovers", "standbys_replaced", "rollouts_lost", "unprotected_spans", "last_commit")
                }
            )
            run.failovers += len(report["failovers"])
            logged = logged_steps(report)
        else:
            logged = attempt.losses(self.steps)
        run.steps.update(logged)

    def _inject(self, run: Run, attempt: Attempt | None, failure: Failure, down: dict[int, float], now: float) -> str:
        """Fire one failure; what it hit ("" when it found nothing to hit)."""
        if failure.target == Target.HOST:
            host = failure.index + 1
            if host in down:
                return ""
            killed = self.cluster.hosts[host].crash()
            down[host] = now + self.reboot_s
            return f"host {host} ({len(killed)} processes)" if killed else ""
        if attempt is None:
            return ""
        # A pair: the standby first, then its trainer (their trainer dying first would be an ordinary failover).
        roles = ("standby", "trainer") if failure.target == Target.PAIR else (str(failure.target),)
        hit = []
        for role in roles:
            pid = attempt.pid_of(role, failure.index)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            hit.append(f"{role} {failure.index} (pid {pid})")
        return " and ".join(hit)


def ends_of(run: Run) -> dict[int, float]:
    """Each step's end (the final model's: a step's last run), to the millisecond."""
    return {s: round(v["at"], 3) for s, v in sorted(run.steps.items())}


def reference_losses(run: Run) -> dict[int, list]:
    return {s: [v["losses"], v["metrics"]] for s, v in run.steps.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/ettr.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=250, help="steps of every run (default 250)")
    p.add_argument(
        "--mtbf",
        default="400,200,100",
        help="mean times between failures, in failure-free steps of the unprotected job (default "
        "400,200,100: a restart of this job costs ~100 of its steps)",
    )
    p.add_argument("--seed", type=int, default=0, help="the failure schedules' seed")
    p.add_argument("--reboot", type=float, default=15.0, help="seconds a lost host takes to come back")
    p.add_argument("--cap", type=float, default=3.0, help="stop a run at this many times its failure-free time")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    p.add_argument(
        "--wait-for-standbys",
        action="store_true",
        help="replica's commits wait for a rank's new standby (its default) instead of training on while "
        "it starts (`--train-while-replacing`: the same protection, since the rank has one copy until "
        "the new standby is up either way)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where ettr.json and ettr.png go")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if any(s not in SYSTEMS for s in systems) or args.steps < 4:
        p.error(f"--systems from {SYSTEMS}; --steps >= 4")
    rates = [float(r) for r in args.mtbf.split(",") if r]
    if not testcluster.available():
        print("bench/ettr.py needs root and `ip netns` (the test cluster)", file=sys.stderr)
        return 2
    # A stop (SIGTERM, Ctrl-C) unwinds, so that the cluster is torn down and every process killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="replica-ettr-"))
    result: dict = {
        "definition": "time in the steps that count toward the final model (each worth its system's "
        "failure-free step time) / wall time from the end of step 1 to the end of the last",
        "steps": args.steps,
        "seed": args.seed,
        "train_while_replacing": not args.wait_for_standbys,
        "reboot_s": args.reboot,
        "cap": args.cap,
        "machine": machine(),
        "work": str(work),
        "replica": {},
        "checkpoint_restart": {},
        "runs": {},
    }
    print(
        f"ETTR bench: {args.steps} steps per run, failure rates (MTBF in steps) {rates}, seed {args.seed}; "
        f"logs in {work}",
        flush=True,
    )
    with NetnsCluster(ClusterConfig(hosts=6)) as cluster:
        bench = Bench(
            cluster,
            work,
            steps=args.steps,
            reboot_s=args.reboot,
            cap=args.cap,
            train_while_replacing=not args.wait_for_standbys,
        )
        # Failure-free: each system's step time, the reference losses, the baseline's save and restart times.
        free = {
            s: bench.run(
                s,
                mtbf_steps=None,
                schedule=[],
                checkpoint_every=max(2, args.steps // 4) if s == "checkpoint_restart" else 0,
                title=f"{s}, no failures",
            )
            for s in systems
        }
        calib = free.get("checkpoint_restart")
        reference = free[systems[0]]
        ends = {s: {k: v["at"] for k, v in run.steps.items()} for s, run in free.items()}
        saves = set(range(calib.checkpoint_every, args.steps + 1, calib.checkpoint_every)) if calib else set()
        warm = set(range(1, args.steps // 4 + 1))  # the engines and standbys still warming up
        step_s = {s: step_time(ends[s], skip=warm | (saves if s == "checkpoint_restart" else set())) for s in systems}
        wall_free = {s: ends[s][args.steps] - ends[s][1] for s in systems}
        result["failure_free"] = {
            s: {
                "step_s": step_s[s],
                "wall_s": wall_free[s],
                "losses_equal_reference": reference_losses(free[s]) == reference_losses(reference),
                # a failure-free run measured as the others (the baseline: its saves)
                "ettr": figures(
                    ends=ends[s],
                    steps=args.steps,
                    clock_start=free[s].clock_start,
                    stopped_at=0.0,
                    interruptions=[],
                    saves=bench.saves(free[s]),
                    fallback_step_s=step_s[s],
                ).ettr,
                "ends": ends_of(free[s]),
            }
            for s in systems
        }
        if calib is not None:
            save_s = statistics.median(bench.saves(calib).values()) if bench.saves(calib) else 0.0
            # A restart costs its launch to the end of its first step, less that step (the restore is
            # of a tiny model here: the processes and the engines' start are most of it).
            restart_s = max(0.0, calib.clock_start - calib.launched_at - step_s["checkpoint_restart"])
            result["failure_free"]["checkpoint_restart"].update(save_s=save_s, restart_s=restart_s)
        unit = step_s.get("checkpoint_restart", step_s[systems[0]])
        for rate in rates:
            mtbf_s = rate * unit
            horizon = args.cap * max(wall_free.values()) * 2
            schedule = poisson_schedule(mtbf_s=mtbf_s, horizon_s=horizon, seed=args.seed + int(rate * 1000))
            result["runs"][str(rate)] = {"mtbf_s": mtbf_s, "schedule": [asdict(f) for f in schedule]}
            for system in systems:
                k = 0
                if system == "checkpoint_restart":
                    info = result["failure_free"]["checkpoint_restart"]
                    k = best_interval(
                        step_s=step_s[system],
                        save_s=info["save_s"],
                        restart_s=info["restart_s"],
                        mtbf_s=mtbf_s,
                        max_interval=args.steps,
                    )
                run = bench.run(
                    system,
                    mtbf_steps=rate,
                    schedule=schedule,
                    checkpoint_every=k,
                    limit_s=args.cap * wall_free[system] + 300,
                    title=f"{system} mtbf={rate:g} steps" + (f" K={k}" if k else ""),
                )
                fig = figures(
                    ends=ends_of(run),
                    steps=args.steps,
                    clock_start=run.clock_start,
                    stopped_at=run.stopped_at,
                    interruptions=run.interruptions,
                    saves=bench.saves(run),
                    fallback_step_s=step_s[system],
                )
                bit_identical = all(
                    reference_losses(run).get(s) == reference_losses(reference).get(s) for s in run.steps
                )
                result[system][f"{rate:g}"] = fig.ettr
                result["runs"][str(rate)][system] = {
                    **asdict(fig),
                    "checkpoint_every": k,
                    "bit_identical": bit_identical and fig.finished,
                    "ends": ends_of(run),
                    "saves": bench.saves(run),
                    "interruptions": run.interruptions,
                    "steps_redone": run.steps_redone,
                    "failovers": run.failovers,
                    "job_restarts": run.job_restarts,
                    "injected": run.injected,
                    "attempts": run.attempts,
                    "reports": run.reports,
                    "mean_recovery_s": sum(fig.recoveries_s) / len(fig.recoveries_s) if fig.recoveries_s else 0.0,
                    "worst_recovery_s": max(fig.recoveries_s, default=0.0),
                }
                print(
                    f"    ETTR {fig.ettr:.3f}  finished {fig.finished}  bit-identical {bit_identical}  "
                    f"restarts {run.job_restarts}  failovers {run.failovers}",
                    flush=True,
                )
    write(result, args.out)
    return 0


def table(result: dict) -> list[str]:
    ff = result["failure_free"]
    lines = [
        f"ETTR, {result['steps']} steps per run (failure-free step: "
        + ", ".join(f"{s} {v['step_s']:.3f} s" for s, v in ff.items())
        + (
            f"; the baseline's save {ff['checkpoint_restart']['save_s']:.2f} s, restart "
            f"{ff['checkpoint_restart']['restart_s']:.1f} s"
            if "checkpoint_restart" in ff
            else ""
        )
        + ")\n",
        "| MTBF (steps / s) | system | ETTR | faults fired / hit | failovers | job restarts | steps redone | "
        "recovery mean / worst (s) | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, runs in result["runs"].items():
        for system in SYSTEMS:
            run = runs.get(system)
            if run is None:
                continue
            hit = sum(1 for i in run["injected"] if i["hit"])
            name = system + (f" (K={run['checkpoint_every']})" if run["checkpoint_every"] else "")
            lines.append(
                f"| {float(rate):g} / {runs['mtbf_s']:.0f} | {name} | {run['ettr']:.3f} | "
                f"{len(run['injected'])} / {hit} | {run['failovers']} | {run['job_restarts']} | "
                f"{run['steps_redone']} | {run['mean_recovery_s']:.1f} / {run['worst_recovery_s']:.1f} | "
                f"{run['bit_identical']} |"
            )
    return lines


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system, style in (("replica", "o-"), ("checkpoint_restart", "s--")):
        points = sorted((100 / float(rate), ettr) for rate, ettr in result.get(system, {}).items())
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], style, label=system.replace("_", "-"))
    ax.set_xlabel("failures per 100 failure-free steps (Poisson)")
    ax.set_ylabel("ETTR")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"RL loop on 6 network-namespace hosts, {result['steps']} steps per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["projection_256_gpus"], projected = projection(result)
    lines = table(result) + projected
    (out / "ettr.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "ettr.md").write_text("\n".join(lines) + "\n")
    png = out / "ettr.png"
    print("\n".join(lines))
    print(f"wrote {out / 'ettr.json'}, {out / 'ettr.md'}" + (f", {png}" if plot(result, png) else ""))


if __name__ == "__main__":
    sys.exit(main())
