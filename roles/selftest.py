"""``replica selftest``: the failover matrix, run where it is pointed (this machine by
default, or a Ray cluster), each faulted run compared bit for bit with its failure-free
reference. Each case is one ``replica launch`` in a process of its own, under a deadline, in
its own folder of the work directory (``--report DIR``): its log, its job report, its
failover timeline and its loss plot. The table it prints (and writes as JSON and markdown)
says per case whether the losses equal the reference's, how fast the failure was detected and
the standby promoted, how many steps were redone and what a step cost against a run without
standbys. Exit 0 only when every case that ran passed."""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.roles.argparsing import Parser, deadline_options, non_negative_int, port, positive_float, positive_int
from replica.roles.env import Action, Role, parse_faults
from replica.roles.exits import ExitCode
from replica.roles.members import Mark
from replica.roles.report import compare_reports, write_loss_png
from replica.roles.selftest_runs import Device, JobKind, Plan, Run, kill_all, launch, target_name

__all__ = [
    "CASES",
    "Case",
    "Device",
    "JobKind",
    "Outcome",
    "Plan",
    "Reference",
    "Result",
    "kill_all",
    "main",
    "parse",
    "plan_of",
    "run_case",
    "run_matrix",
    "run_reference",
    "select_cases",
    "unavailable",
]


class Outcome(enum.StrEnum):
    PASSED = "bit-identical"
    BASELINE = "baseline"  # the unmirrored run: what the others' step time is compared with
    DIFFERS = "differs"  # the losses (or the divergence guard) differ from the reference
    FAILED = "failed"  # the run did not finish, or its fault did not fire
    SKIPPED = "skipped"  # this target cannot run it (the reason says why)


@dataclass(kw_only=True, frozen=True, slots=True)
class Case:
    """One faulted run. ``inject`` is a ``--inject`` spec in which ``{a}`` and ``{b}`` are two
    trainer ranks (the first and the last: the same rank at world size 1)."""

    name: str
    job: JobKind
    inject: str
    #: What passing it shows, for the report and the docs.
    proves: str
    quick: bool = False
    #: The fewest trainers the case means something with.
    min_trainers: int = 1
    #: Runs with a durable floor (``--durable``): a rank that lost every in-memory copy of its state.
    durable: bool = False
    #: Runs only on host agents (``--agents``), at least this many: a host fault needs an agent to fire it.
    min_agents: int = 0

    def spec(self, trainers: int) -> str:
        return self.inject.format(a=0, b=trainers - 1)


CASES = (
    Case(
        name="trainer-forward",
        job=JobKind.FSDP,
        inject="kill:trainer:{b}@5:forward",
        proves="a trainer lost in its forward pass: its standby takes the last global commit, the survivors roll back",
    ),
    Case(
        name="trainer-backward",
        job=JobKind.FSDP,
        inject="kill:trainer:{a}@5:backward",
        quick=True,
        proves="a trainer lost in its backward pass, gradients half made",
    ),
    Case(
        name="trainer-reduce-scatter",
        job=JobKind.FSDP,
        inject="kill:trainer:{a}@5:reduce-scatter",
        min_trainers=2,
        proves="a trainer lost inside FSDP2's gradient reduce-scatter: the survivors' collective fails and is redone",
    ),
    Case(
        name="trainer-optimizer",
        job=JobKind.FSDP,
        inject="kill:trainer:{b}@5:optimizer",
        proves="a trainer lost in its optimizer step, its parameters half updated",
    ),
    Case(
        name="trainer-commit",
        job=JobKind.FSDP,
        inject="kill:trainer:{a}@5:commit",
        proves="a trainer lost in the global commit: the step counts once, whether or not it was committed",
    ),
    Case(
        name="trainer-mirror",
        job=JobKind.FSDP,
        inject="kill:trainer:{b}@5:mirror",
        proves="a trainer lost while streaming its shard to its standby: the standby keeps the last whole commit",
    ),
    Case(
        name="standby-killed",
        job=JobKind.FSDP,
        inject="kill:standby:{a}@4",
        quick=True,
        proves="a standby lost: a new one is started and filled; the trainers never stop",
    ),
    Case(
        name="trainer-frozen",
        job=JobKind.FSDP,
        inject="freeze:trainer:{b}@5:backward",
        quick=True,
        proves="a trainer alive but silent (SIGSTOP) past its heartbeat deadline: judged dead, fenced, replaced",
    ),
    Case(
        name="two-trainers",
        job=JobKind.FSDP,
        inject="kill:trainer:{a}@3:backward,kill:trainer:{b}@7:optimizer",
        proves="two trainers lost one after the other: the second failover starts from the first's replacement",
    ),
    Case(
        name="hf-optimizer",
        job=JobKind.HF,
        inject="kill:trainer:{b}@5:optimizer",
        proves="a Hugging Face model (mixed precision, dropout, a StatefulDataLoader) lost in its optimizer step",
    ),
    Case(
        name="rl-trainer",
        job=JobKind.RL,
        inject="kill:trainer:{a}@4:backward",
        proves="the RL loop: a trainer lost; the rollouts of the step are the same, the policy is the same",
    ),
    Case(
        name="rl-rollout",
        job=JobKind.RL,
        inject="kill:rollout:1@3",
        proves="the RL loop: a vLLM engine lost while generating; the others take its prompts, nothing changes",
    ),
    # The coordinator places trainer r on agent r (the least loaded agent first, in index order):
    # host {b} is trainer {b}'s; its standby is on another host, its new standby goes to a third.
    Case(
        name="host-lost",
        job=JobKind.FSDP,
        inject="kill:host:{b}@5",
        min_agents=3,
        proves="a host lost whole (its agent and every process on it, as a machine that dies): its trainer's "
        "standby on another host takes over, and a new standby starts on a third",
    ),
    # Trainer {a} stalls 2 s in step 4: time for version 3 to be written whole on a loaded machine.
    Case(
        name="trainer-and-standby",
        job=JobKind.FSDP,
        durable=True,
        inject="stall:trainer:{a}@4:2,kill:standby:{b}@5,kill:trainer:{b}@7:optimizer",
        proves="a trainer lost with its own standby (no copy of its state left in memory): every rank goes back "
        "to the durable floor's newest complete version and replays from it",
    ),
)


@dataclass(kw_only=True, slots=True)
class Result:
    case: str
    job: JobKind
    inject: str
    outcome: Outcome
    why: str = ""
    log: str = ""
    seconds: float = 0.0
    detect_ms: list[float] = field(default_factory=list)
    promote_ms: list[float] = field(default_factory=list)
    resumed_ms: list[float] = field(default_factory=list)
    steps_redone: int | None = None
    step_ms: float | None = None
    #: The median step against the unmirrored run's, as a fraction (0.05: 5 % slower).
    overhead: float | None = None

    def to_dict(self) -> dict:
        return {
            k: (str(v) if isinstance(v, enum.Enum) else v)
            for k, v in ((name, getattr(self, name)) for name in self.__slots__)
        }


def select_cases(
    *, quick: bool, only: tuple[str, ...] = (), durable: bool = False, agents: bool = False
) -> tuple[Case, ...]:
    """The cases named (``only``), or the quick ones, or all; a durable case only with a floor
    (``durable``), a host case only on host agents (``agents``); named, such a case is skipped
    where it cannot run, saying so."""

    def chosen(c: Case) -> bool:
        if c.durable or c.min_agents:
            return (not c.durable or durable) and (not c.min_agents or agents) and (c.durable or not quick)
        return c.quick or not quick

    cases = tuple(c for c in CASES if (c.name in only if only else chosen(c)))
    unknown = set(only) - {c.name for c in CASES}
    if unknown:
        raise ValueError(f"no case {', '.join(sorted(unknown))} (the cases: {', '.join(c.name for c in CASES)})")
    return cases


def _unavailable(kind: JobKind, plan: Plan) -> str:
    """Why this target cannot run a job of ``kind`` ("" when it can)."""
    if kind == JobKind.HF:
        missing = [m for m in ("transformers", "torchdata") if importlib.util.find_spec(m) is None]
        return f"needs {' and '.join(missing)} (pip install transformers torchdata)" if missing else ""
    if kind == JobKind.RL:
        if plan.device == Device.CUDA:
            return "the RL example's trainers run on the CPU: its cases run with --device cpu"
        return "" if importlib.util.find_spec("vllm") is not None else "needs vLLM (pip install 'replica[vllm]')"
    return ""


def _median_step_ms(report: dict) -> float | None:
    ends = [t for t in report.get("step_end_times", {}).get("0", []) if t is not None]
    gaps = [(b - a) * 1000 for a, b in zip(ends, ends[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def _steps_redone(report: dict) -> int:
    """Steps computed twice: a trainer killed in step S, its rank resumed from commit C, redoes
    C+1 .. S (none when the step it died in was committed)."""
    lost = [f for f in report["faults"] if f.get("fired_at")]
    failovers = list(report["failovers"])
    redone = 0
    for entry in lost:
        (fault,) = parse_faults(entry["fault"])
        if fault.role != Role.TRAINER or fault.action not in (Action.KILL, Action.FREEZE):
            continue
        match = next((f for f in failovers if f["rank"] == fault.rank), None)
        if match is not None and match["commit"] is not None:
            failovers.remove(match)
            redone += max(0, fault.step - match["commit"])
    return redone


def _last_trainer_kill(report: dict) -> int:
    kills = [
        fault
        for entry in report["faults"]
        if entry.get("fired_at")
        for fault in parse_faults(entry["fault"])
        if fault.role == Role.TRAINER and fault.action == Action.KILL
    ]
    return max((f.step for f in kills), default=0)


def _judge(
    name: str,
    kind: JobKind,
    inject: str,
    run: Run,
    reference: dict | None,
    baseline_ms: float | None,
    *,
    plan: Plan,
    durable: bool = False,
) -> Result:
    result = Result(case=name, job=kind, inject=inject, outcome=Outcome.FAILED, log=str(run.log), seconds=run.seconds)
    report = run.report
    if run.code is None:
        result.why = f"did not end in {plan.case_timeout.total_seconds():.0f} s (killed)"
        return result
    if report is None:
        result.why = f"exit code {run.code}, no job report"
        return result
    unfired = [f["fault"] for f in report["faults"] if not f.get("fired_at")]
    if unfired:
        result.why = f"the fault {', '.join(unfired)} did not fire"
        return result
    if run.code != 0:
        result.why = f"exit code {run.code}" + (f": {report['failure']}" if report.get("failure") else "")
        return result
    for failover in report["failovers"]:
        marks = failover["timeline_ms"]
        for attribute, mark in (("detect_ms", Mark.DETECT), ("promote_ms", Mark.PROMOTE), ("resumed_ms", Mark.RESUMED)):
            if mark in marks:
                getattr(result, attribute).append(round(marks[mark], 1))
    result.steps_redone = _steps_redone(report)
    if durable:
        resumed = [r for r in report.get("restarts", []) if "resumed_from_floor" in r]
        if not resumed:
            result.why = "the lost pair did not send the job back to its durable floor"
            return result
        version, lost = resumed[0]["resumed_from_floor"], resumed[0]["lost_commit"]
        result.steps_redone = _last_trainer_kill(report) - version  # every rank replays from the version
        result.why = f"resumed from the floor's version {version} ({lost - version} committed steps replayed)"
    result.step_ms = _median_step_ms(report)
    if result.step_ms is not None and baseline_ms:
        result.overhead = result.step_ms / baseline_ms - 1
    if reference is None:
        result.outcome = Outcome.BASELINE
        return result
    problems = compare_reports(reference, report)
    write_loss_png(reference, report, run.log.parent / "losses.png", names=("reference", name))
    if problems:
        result.outcome, result.why = Outcome.DIFFERS, f"{len(problems)} differences; the first: {problems[0]}"
        return result
    result.outcome = Outcome.PASSED
    return result


@dataclass(kw_only=True, frozen=True, slots=True)
class Reference:
    """A job's two failure-free runs: without standbys (``baseline``: the step time the others
    are compared with) and with standbys (``result``: it must equal the baseline bit for bit;
    its report is what each case is compared with)."""

    baseline: Result
    result: Result
    report: dict | None

    @property
    def passed(self) -> bool:
        return self.result.outcome == Outcome.PASSED


def unavailable(case: Case, plan: Plan) -> str:
    """Why ``plan``'s target cannot run ``case`` ("" when it can)."""
    why = _unavailable(case.job, plan)
    if not why and case.min_trainers > plan.num_trainers:
        why = f"needs --trainers {case.min_trainers} or more"
    if not why and case.min_agents > plan.agents:
        why = f"needs host agents: --agents {case.min_agents} or more (`replica agent --serve` on each host)"
    if not why and case.durable and plan.durable is None:
        why = "needs --durable DIR (where the standbys write the floor it goes back to)"
    return why


def run_reference(
    plan: Plan,
    kind: JobKind,
    *,
    running: list[subprocess.Popen],
    step: Callable[[str], None] = lambda _: None,
    say: Callable[[str], None] = print,
) -> Reference:
    """The baseline and the reference of a job of ``kind`` (the reference only if the baseline ran)."""
    step(f"{kind} job, unmirrored baseline (no standbys)")
    baseline = launch(plan, kind, f"{kind}-unmirrored", standbys=False, running=running)
    first = _judge(f"{kind}-unmirrored", kind, "", baseline, None, None, plan=plan)
    say(_progress(first))
    step(f"{kind} job, reference (standbys, no fault)")
    report = None
    if first.outcome == Outcome.BASELINE:
        reference = launch(plan, kind, f"{kind}-reference", running=running)
        # Standbys change no loss: the reference equals the unmirrored run bit for bit.
        ref = _judge(f"{kind}-reference", kind, "", reference, baseline.report, first.step_ms, plan=plan)
        report = reference.report
    else:
        ref = Result(
            case=f"{kind}-reference",
            job=kind,
            inject="",
            outcome=Outcome.FAILED,
            why=f"the unmirrored run failed: {first.why}",
        )
    say(_progress(ref))
    return Reference(baseline=first, result=ref, report=report)


def run_case(plan: Plan, case: Case, reference: Reference, *, running: list[subprocess.Popen]) -> Result:
    """One faulted run of ``case``, judged against its job's ``reference``."""
    inject = case.spec(plan.num_trainers)
    if not reference.passed:
        return Result(
            case=case.name,
            job=case.job,
            inject=inject,
            outcome=Outcome.FAILED,
            why=f"its reference run failed: {reference.result.why}",
            log=reference.result.log,
        )
    run = launch(plan, case.job, case.name, inject=inject, running=running, durable=case.durable)
    return _judge(
        case.name, case.job, inject, run, reference.report, reference.baseline.step_ms, plan=plan, durable=case.durable
    )


def run_matrix(plan: Plan, cases: tuple[Case, ...], *, say: Callable[[str], None] = print) -> list[Result]:
    """Every case of ``cases`` (and, per job, its unmirrored baseline and failure-free
    reference), one after the other; a case that cannot run here is SKIPPED with its reason.
    The runs still going are killed when this returns, even by KeyboardInterrupt."""
    results: list[Result] = []
    running: list[subprocess.Popen] = []
    runnable = []
    for case in cases:
        if why := unavailable(case, plan):
            results.append(
                Result(
                    case=case.name, job=case.job, inject=case.spec(plan.num_trainers), outcome=Outcome.SKIPPED, why=why
                )
            )
        else:
            runnable.append(case)
    total = len(runnable) + 2 * len({c.job for c in runnable})
    done = 0

    def step(name: str) -> None:
        nonlocal done
        done += 1
        say(f"replica selftest: [{done}/{total}] {name} ...")

    try:
        for kind in JobKind:
            jobs = [c for c in runnable if c.job == kind]
            if not jobs:
                continue
            reference = run_reference(plan, kind, running=running, step=step, say=say)
            results += [reference.baseline, reference.result]
            for case in jobs:
                step(f"{case.name} ({case.spec(plan.num_trainers)})")
                result = run_case(plan, case, reference, running=running)
                say(_progress(result))
                results.append(result)
    finally:
        kill_all(running)
    return results


def _ms(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values) if values else "-"


def _progress(result: Result) -> str:
    line = f"replica selftest:     {result.case}: {result.outcome}"
    if result.outcome in (Outcome.PASSED, Outcome.DIFFERS) and result.detect_ms:
        line += f" (detect {_ms(result.detect_ms)} ms, resumed {_ms(result.resumed_ms)} ms)"
    if result.why:
        line += f": {result.why}" + (f" (log: {result.log})" if result.outcome != Outcome.PASSED else "")
    return line


_COLUMNS = (
    "case",
    "job",
    "result",
    "detect ms",
    "promote ms",
    "resumed ms",
    "steps redone",
    "step ms",
    "vs unmirrored",
)


def table(results: list[Result]) -> list[str]:
    """The results as a markdown table (several failovers in a case: their times joined by /)."""
    rows = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in results:
        cells = (
            r.case,
            str(r.job),
            str(r.outcome),
            _ms(r.detect_ms),
            _ms(r.promote_ms),
            _ms(r.resumed_ms),
            "-" if r.steps_redone is None else str(r.steps_redone),
            "-" if r.step_ms is None else f"{r.step_ms:.0f}",
            "-" if r.overhead is None else f"{r.overhead:+.0%}",
        )
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _write(plan: Plan, cases: tuple[Case, ...], results: list[Result], *, seconds: float) -> None:
    summary = {
        "device": str(plan.device),
        "trainers": plan.num_trainers,
        "steps": plan.steps,
        "target": target_name(plan),
        "seconds": round(seconds, 1),
        "passed": all(r.outcome in (Outcome.PASSED, Outcome.BASELINE, Outcome.SKIPPED) for r in results),
        "results": [r.to_dict() for r in results],
    }
    (plan.directory / "selftest.json").write_text(json.dumps(summary, indent=1) + "\n")
    proves = {c.name: c.proves for c in cases}
    lines = [
        f"# replica selftest: {plan.num_trainers} trainers, {plan.steps} steps, {plan.device}, "
        f"{target_name(plan)} ({seconds:.0f} s)",
        "",
        *table(results),
        "",
    ]
    lines += [
        f"- **{r.case}** ({r.inject}): {proves[r.case]}" + (f" -- {r.outcome}: {r.why}" if r.why else "")
        for r in results
        if r.case in proves
    ]
    (plan.directory / "selftest.md").write_text("\n".join(lines) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="replica selftest", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="three cases (" + ", ".join(c.name for c in CASES if c.quick) + ") of the FSDP2 job, and "
        "with --durable the durable ones (" + ", ".join(c.name for c in CASES if c.durable) + ")",
    )
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this case (repeatable): " + ", ".join(c.name for c in CASES),
    )
    p.add_argument(
        "--device",
        choices=tuple(Device),
        default=Device.CPU,
        help="cuda: every role on a GPU (rank r on GPU r mod the GPUs visible), NCCL; cpu: gloo",
    )
    p.add_argument("--trainers", type=positive_int, default=2, help="the world size of every job")
    p.add_argument("--steps", type=positive_int, default=10, help="steps of every job (at least 8)")
    p.add_argument(
        "--ray",
        default="",
        metavar="ADDRESS",
        help="run every job on the Ray cluster at ADDRESS (host:port of its GCS), each role a Ray actor "
        "(needs replica[ray] here and on the cluster)",
    )
    p.add_argument(
        "--agents",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="run every job's roles on the N host agents started with `replica agent --store HOST:PORT "
        "--index I --serve` (I = 0 .. N-1, one per host): each job's coordinator runs here and listens "
        "at --host:--port, their --store",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="with --agents: this host's address the agents reach (their --store's host)"
    )
    p.add_argument("--port", type=port, default=29400, help="with --agents: the port of their --store")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="the work directory: each case's log, job report and plots, and selftest.json/.md "
        "(default: a new folder replica-selftest-* in the system's temporary folder)",
    )
    deadline_options(p)
    p.add_argument(
        "--case-timeout",
        type=positive_float,
        default=300.0,
        help="seconds before a case is abandoned and its processes killed",
    )
    p.add_argument(
        "--durable",
        type=Path,
        default=None,
        metavar="DIR",
        help="add the case of a trainer lost with its own standby: its jobs write a durable floor to "
        "DIR/CASE (local to each host, or shared) and go back to it",
    )
    p.add_argument(
        "--unmirrored-noise",
        action="store_true",
        help="plant a divergence: the Hugging Face job draws from a generator outside the mirrored state, "
        "so each of its faulted cases must fail (a check that the check can fail)",
    )
    return p


def _refusal(args: argparse.Namespace) -> str:
    """Why this selftest cannot start ("" when it can), checked before anything runs."""
    if args.steps < 8:
        return f"--steps {args.steps}: the cases fire faults up to step 7; need --steps 8 or more"
    if args.report is not None and args.report.exists() and (not args.report.is_dir() or any(args.report.iterdir())):
        return f"--report {args.report}: not an empty folder (the selftest writes only in a folder of its own)"
    if args.report is not None and not args.report.resolve().parent.is_dir():
        return f"--report {args.report}: its folder {args.report.resolve().parent} does not exist"
    if args.durable is not None and not args.durable.resolve().parent.is_dir():
        return f"--durable {args.durable}: its folder {args.durable.resolve().parent} does not exist"
    if args.durable is not None and args.durable.exists() and not args.durable.is_dir():
        return f"--durable {args.durable}: not a folder"
    if args.agents and args.ray:
        return "--agents and --ray: pick one target"
    if args.agents == 1:
        return "--agents 1: a standby never shares its trainer's host, so the matrix needs 2 host agents or more"
    if args.agents and not os.environ.get(envvars.TOKEN):
        return f"--agents: set {envvars.TOKEN} to the secret the agents were started with"
    if args.agents and (why := _port_taken(args.host, args.port)):
        return why
    if args.device == Device.CUDA and not args.ray and not args.agents:
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: this machine has no CUDA device torch can use (torch.cuda.is_available() is False)"
        if torch.cuda.device_count() < args.trainers:
            return (
                f"--device cuda --trainers {args.trainers}: NCCL needs a GPU per trainer and this machine has "
                f"{torch.cuda.device_count()}; pass --trainers {torch.cuda.device_count()} or point --ray at a "
                "cluster"
            )
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            return "--ray needs Ray here: pip install 'replica[ray]'"
        if args.ray != "auto":
            return _unreachable(args.ray)
    return ""


def _unreachable(address: str) -> str:
    host, _, port_text = address.removeprefix("ray://").rpartition(":")
    if not host or not port_text.isdigit():
        return f"--ray {address}: need HOST:PORT (the Ray head's GCS address, e.g. 10.0.0.1:6379) or 'auto'"
    try:
        with socket.create_connection((host, int(port_text)), timeout=5):
            return ""
    except OSError as exc:
        return f"--ray {address}: cannot reach the Ray head there ({exc.strerror or exc})"


def _port_taken(host: str, number: int) -> str:
    """Why each job's coordinator could not listen at ``host``:``number`` ("" when it can)."""
    with socket.socket() as s:
        try:
            s.bind((host, number))
        except OSError as exc:
            return f"--host {host} --port {number}: cannot listen there for the agents ({exc.strerror or exc})"
    return ""


def _deadline_argv(args: argparse.Namespace) -> tuple[str, ...]:
    argv = ("--heartbeat-deadline", str(args.heartbeat_deadline))
    return argv + (("--standby-deadline", str(args.standby_deadline)) if args.standby_deadline else ())


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, tuple[Case, ...]]:
    """The command line and the cases it selects; bad input exits 2 with one line (argparse's)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cases = select_cases(
            quick=args.quick, only=tuple(args.case), durable=args.durable is not None, agents=args.agents > 0
        )
    except ValueError as exc:
        parser.error(str(exc))
    if why := _refusal(args):
        parser.error(why)
    return args, cases


def plan_of(args: argparse.Namespace) -> Plan:
    """``parse``'s command line as a plan; its work directory is made (a new temporary one by default)."""
    directory = args.report or Path(tempfile.mkdtemp(prefix="replica-selftest-"))
    directory.mkdir(exist_ok=True)
    return Plan(
        device=Device(args.device),
        num_trainers=args.trainers,
        steps=args.steps,
        directory=directory.resolve(),
        case_timeout=timedelta(seconds=args.case_timeout),
        ray=args.ray,
        agents=args.agents,
        host=args.host,
        port=args.port,
        unmirrored_noise=args.unmirrored_noise,
        launch_options=_deadline_argv(args),
        durable=None if args.durable is None else args.durable.resolve(),
    )


def main(argv: list[str] | None = None) -> int:
    args, cases = parse(argv)
    plan = plan_of(args)
    print(
        f"replica selftest: {len(cases)} cases, {plan.num_trainers} trainers, {plan.steps} steps, {plan.device}, "
        f"on {target_name(plan)}; work directory {plan.directory}",
        flush=True,
    )
    started = time.monotonic()
    results: list[Result] = []
    try:
        results = run_matrix(plan, cases, say=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("replica selftest: interrupted; its processes are stopped", flush=True)
        return 130
    seconds = time.monotonic() - started
    _write(plan, cases, results, seconds=seconds)
    print("\n".join(table(results)))
    bad = [r for r in results if r.outcome not in (Outcome.PASSED, Outcome.BASELINE, Outcome.SKIPPED)]
    for r in bad:
        print(f"replica selftest: {r.case} {r.outcome}: {r.why} (log: {r.log})")
    names = {c.name for c in cases}
    count = {o: sum(r.outcome == o for r in results if r.case in names) for o in Outcome}
    print(
        f"replica selftest: {count[Outcome.PASSED]} of {len(cases)} cases bit-identical, "
        f"{count[Outcome.DIFFERS]} differ, {count[Outcome.FAILED]} failed, {count[Outcome.SKIPPED]} skipped"
        + (
            f" ({len(bad) - count[Outcome.DIFFERS] - count[Outcome.FAILED]} reference runs failed)"
            if len(bad) > count[Outcome.DIFFERS] + count[Outcome.FAILED]
            else ""
        )
        + f", in {seconds:.0f} s; report in {plan.directory / 'selftest.md'}",
        flush=True,
    )
    return ExitCode.FAILED if bad else ExitCode.OK
