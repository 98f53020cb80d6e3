"""Where ``replica selftest`` runs its jobs, and how: each run one launcher process (``replica
launch`` on this machine or ``--ray``; ``replica coordinator`` serving the job to the host
agents of ``--agents``), in a process group of its own, under the case's deadline, in its own
folder of the work directory."""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.roles.report import load_report

__all__ = ["Device", "EXAMPLES", "JobKind", "Plan", "Run", "kill_all", "launch", "target_name"]

#: The example jobs, shipped beside the package (``replica/examples``; ``examples/`` in a checkout).
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: Seconds a launcher is given, beyond its own ``--timeout``, to end before it is killed.
_GRACE_S = 30.0
#: The durable floor's cadence in the cases that have one (versions 3, 6, ...).
_DURABLE_EVERY = 3


class Device(enum.StrEnum):
    CPU = "cpu"  # gloo
    CUDA = "cuda"  # NCCL; rank r on GPU r mod the GPUs visible


class JobKind(enum.StrEnum):
    """The jobs the matrix runs: the project's FSDP2 example, a Hugging Face model with a real
    data loader, the RL loop with vLLM engines."""

    FSDP = "fsdp"
    HF = "hf"
    RL = "rl"


@dataclass(kw_only=True, frozen=True, slots=True)
class Plan:
    """What a selftest runs, and where."""

    device: Device
    num_trainers: int
    steps: int
    directory: Path
    case_timeout: timedelta
    #: ``replica launch --ray ADDRESS`` ("": not on Ray).
    ray: str = ""
    #: The host agents (``replica agent --serve``) that run every job's roles (0: none); each job's
    #: coordinator listens at ``host``:``port``, the agents' ``--store``.
    agents: int = 0
    host: str = "127.0.0.1"
    port: int = 29400
    #: The Hugging Face job draws from a generator outside the mirrored state: every case of it must fail.
    unmirrored_noise: bool = False
    #: The launcher's deadline options, passed on as they were given.
    launch_options: tuple[str, ...] = ()
    #: ``--durable DIR``: the floors of the durable cases (DIR/CASE; a folder every trainer host can write).
    durable: Path | None = None


def target_name(plan: Plan) -> str:
    """Where ``plan`` runs, in words."""
    if plan.agents:
        return f"{plan.agents} host agents ({plan.host}:{plan.port})"
    return plan.ray or "this machine"  # a Ray cluster: its address


@dataclass(kw_only=True, frozen=True, slots=True)
class Run:
    code: int | None  # None: killed at its deadline
    report: dict | None
    log: Path
    seconds: float


def _job_args(kind: JobKind, plan: Plan) -> tuple[list[str], list[str]]:
    """The launcher's options and the script with its arguments, for a job of ``kind``."""
    if kind == JobKind.FSDP:
        return [], [str(EXAMPLES / "train_fsdp.py"), "--device", str(plan.device)]
    if kind == JobKind.HF:
        noise = ["--unmirrored-noise"] if plan.unmirrored_noise else []
        return [], [str(EXAMPLES / "train_hf.py"), "--device", str(plan.device), "--loader", "stateful", *noise]
    return ["--rollouts", "2"], [str(EXAMPLES / "rl_loop.py")]


def _argv(plan: Plan, kind: JobKind, *, inject: str, standbys: bool, durable: Path | None) -> tuple[list[str], dict]:
    """The launcher's command line for one run, and what it adds to its environment."""
    options, script = _job_args(kind, plan)
    common = [
        "--steps",
        str(plan.steps),
        "--report",
        "run.json",
        "--timeout",
        str(plan.case_timeout.total_seconds()),
        "--export-dir",
        "export",
        *plan.launch_options,
        *options,
    ]
    if not standbys:
        common += ["--standbys", "0"]
    if plan.agents:
        # The coordinator serves the job to the agents: the script, and the roles' settings from its environment.
        env = {envvars.INJECT: inject}
        if durable is not None:
            env.update(
                {
                    envvars.DURABLE: str(durable),
                    envvars.DURABLE_EVERY: str(_DURABLE_EVERY),
                    envvars.DURABLE_INTERVAL: "0",
                }
            )
        argv = [
            "coordinator",
            "--world-size",
            str(plan.num_trainers),
            "--host",
            plan.host,
            "--port",
            str(plan.port),
            "--agents",
            str(plan.agents),
            *common,
            *(["--replacements", "0"] if durable is not None else []),
        ]
        return [*argv, *script], env
    argv = ["launch", "--trainers", str(plan.num_trainers), *common]
    if durable is not None:
        argv += [
            "--durable",
            str(durable),
            "--durable-every",
            str(_DURABLE_EVERY),
            "--durable-interval",
            "0",
            "--replacements",
            "0",
        ]
    if inject:
        argv += ["--inject", inject]
    # One machine holds every role: a standby shares its trainer's host by construction there.
    argv += ["--ray", plan.ray] if plan.ray else ["--allow-shared-domain"]
    return [*argv, *script], {}


def launch(
    plan: Plan,
    kind: JobKind,
    name: str,
    *,
    inject: str = "",
    standbys: bool = True,
    running: list[subprocess.Popen],
    durable: bool = False,
) -> Run:
    """One run of a job of ``kind``, in ``plan.directory / name``, under the case deadline: its
    process group is killed when it runs past it. ``durable``: with a floor in ``plan.durable /
    name`` and no replacement standby (a lost pair stays lost)."""
    folder = plan.directory / name
    folder.mkdir(parents=True, exist_ok=True)
    argv, env = _argv(
        plan,
        kind,
        inject=inject,
        standbys=standbys,
        durable=plan.durable / name if durable and plan.durable is not None else None,
    )
    log = folder / "run.log"
    started = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        process = subprocess.Popen(
            [sys.executable, "-m", "replica.roles.cli", *argv],
            cwd=folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
        running.append(process)
        try:
            code = process.wait(timeout=plan.case_timeout.total_seconds() + _GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(process)
            running.remove(process)
    report = None
    if (folder / "run.json").is_file():
        try:
            report = load_report(folder / "run.json")
        except ValueError:
            report = None
    return Run(code=code, report=report, log=log, seconds=time.monotonic() - started)


def _kill_group(process: subprocess.Popen) -> None:
    """The launcher's process group, killed (its roles die with it); a no-op once it ended."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def kill_all(running: list[subprocess.Popen]) -> None:
    """Every launcher still running, with its roles."""
    for process in list(running):
        _kill_group(process)
