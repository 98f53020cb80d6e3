"""Running jobs as users do, from the tests: `replica launch` of the demo job
(examples/train_fsdp.py) or the RL loop (examples/rl_loop.py) to its report, and the
multi-node way (`replica coordinator` alone, each role's environment set by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from replica.timing import Deadline

__all__ = [
    "EXAMPLE",
    "RL",
    "RL_STEPS",
    "ROOT",
    "STEPS",
    "TOKEN",
    "launch",
    "launch_command",
    "role_env",
    "start_coordinator",
    "wait_for_key",
]

ROOT = Path(__file__).resolve().parents[2]  # the repository
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
STEPS = 10
RL = ROOT / "examples" / "rl_loop.py"  # the RL loop, and the steps of its test runs
RL_STEPS = 6
TOKEN = "test-job-token-7f3a9c"


def launch_command(
    tmp_path: Path,
    *options: str,
    name: str = "run",
    script: Path = EXAMPLE,
    steps: int = STEPS,
    script_args: tuple[str, ...] = (),
    timeout_s: float = 240,
) -> list[str]:
    """The `replica launch` command line of ``launch`` (its report: ``tmp_path / f"{name}.json"``)."""
    return [
        sys.executable,
        "-m",
        "replica.roles.cli",
        "launch",
        "--steps",
        str(steps),
        "--timeout",
        str(timeout_s),
        "--report",
        str(tmp_path / f"{name}.json"),
        "--export-dir",
        str(tmp_path / f"{name}-export"),
        *options,
        str(script),
        *script_args,
    ]


def launch(
    tmp_path: Path,
    *options: str,
    name: str = "run",
    script: Path = EXAMPLE,
    steps: int = STEPS,
    script_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 240,
) -> tuple[int, dict, str]:
    """`replica launch` of ``script`` (the demo job unless told) from the repository root, to
    its end: its exit code, its report (``tmp_path / f"{name}.json"``) and its output."""
    report = tmp_path / f"{name}.json"
    proc = subprocess.run(
        launch_command(
            tmp_path, *options, name=name, script=script, steps=steps, script_args=script_args, timeout_s=timeout_s
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        env=None if env is None else dict(os.environ, **env),
    )
    output = proc.stdout + proc.stderr
    assert report.exists(), output[-4000:]
    return proc.returncode, json.loads(report.read_text()), output


def wait_for_key(store: dist.Store, key: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until ``key`` is in ``store``; fails when ``proc`` (the job) ends first, or after ``timeout_s``."""
    deadline = Deadline.after(timedelta(seconds=timeout_s))
    while not store.check([key]):
        assert proc.poll() is None, "the job ended early"
        assert not deadline.expired, f"{key} never appeared"
        time.sleep(0.05)


def role_env(port: int, role: str, rank: int, **extra: str) -> dict[str, str]:
    """A role's environment as a multi-node job sets it: torchrun-style RANK/WORLD_SIZE/MASTER_ADDR."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICA_")}
    env.update(
        REPLICA_ROLE=role,
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        REPLICA_STORE_PORT=str(port),
        REPLICA_TOKEN=TOKEN,
        REPLICA_STEPS=str(STEPS),
        TORCH_GLOO_LAZY_INIT="1",
    )
    return dict(env, **extra)


def start_coordinator(port: int, report: Path, *options: str, steps: int = STEPS, **env: str) -> subprocess.Popen:
    """`replica coordinator` alone (the multi-node way), its output captured; its store is up on return."""
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replica.roles.cli",
            "coordinator",
            "--world-size",
            "2",
            "--steps",
            str(steps),
            "--port",
            str(port),
            "--timeout",
            "240",
            "--report",
            str(report),
            *options,
        ],
        cwd=ROOT,
        env=dict(os.environ, REPLICA_TOKEN=TOKEN, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(1)
    return coordinator
