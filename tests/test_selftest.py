"""`replica selftest`: the failover matrix in one command, run as a user runs it (the
`replica` command in a process of its own), on this machine."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from replica import envvars
from replica.roles.selftest import CASES, Device, Plan, run_matrix, select_cases
from replica.timing import Deadline

SELFTEST = [sys.executable, "-m", "replica.roles.cli", "selftest"]


def _run(*args: str, cwd: Path, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*SELFTEST, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def _job_report(work: Path, case: str) -> dict:
    return json.loads((work / case / "run.json").read_text())


def test_quick_matrix_passes_and_each_fault_fired(tmp_path):
    """--quick: three cases of the FSDP2 job, each against its failure-free reference, after the
    reference itself matched the run without standbys. Each fault fired and was handled the way
    its case says; nothing is written outside the work directory."""
    cwd, work = tmp_path / "cwd", tmp_path / "work"
    cwd.mkdir()
    done = _run("--quick", "--steps", "8", "--report", str(work), "--durable", str(tmp_path / "floor"), cwd=cwd)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    out = done.stdout
    assert "4 of 4 cases bit-identical, 0 differ, 0 failed, 0 skipped" in out, out[-3000:]
    assert "| case | job | result | detect ms |" in out and "[6/6] trainer-and-standby" in out, out[-3000:]
    summary = json.loads((work / "selftest.json").read_text())
    outcomes = {r["case"]: r["outcome"] for r in summary["results"]}
    assert outcomes == {
        "fsdp-unmirrored": "baseline",
        "fsdp-reference": "bit-identical",
        "trainer-backward": "bit-identical",
        "standby-killed": "bit-identical",
        "trainer-frozen": "bit-identical",
        "trainer-and-standby": "bit-identical",
    }, outcomes
    assert summary["passed"] is True
    # --durable: the pair's loss sent every rank back to the floor, which the case's own folder holds
    (pair,) = [r for r in summary["results"] if r["case"] == "trainer-and-standby"]
    (resumed,) = [r for r in _job_report(work, "trainer-and-standby")["restarts"] if "resumed_from_floor" in r]
    assert f"resumed from the floor's version {resumed['resumed_from_floor']}" in pair["why"], pair
    assert pair["steps_redone"] == 7 - resumed["resumed_from_floor"], pair
    assert [p.name for p in (tmp_path / "floor").iterdir()] == ["trainer-and-standby"]
    for case in ("trainer-backward", "standby-killed", "trainer-frozen", "trainer-and-standby"):
        report = _job_report(work, case)
        assert report["faults"] and all(f["fired_at"] is not None for f in report["faults"]), (case, report["faults"])
        assert (work / case / "run.log").is_file()
    (killed,) = _job_report(work, "trainer-backward")["failovers"]
    assert killed["rank"] == 0 and killed["reason"] == "exit code -9", killed
    (frozen,) = _job_report(work, "trainer-frozen")["failovers"]
    assert frozen["rank"] == 1 and "heartbeat" in frozen["reason"], frozen  # found by its deadline, not an exit
    assert _job_report(work, "standby-killed")["failovers"] == []
    assert [r["rank"] for r in _job_report(work, "standby-killed")["standbys_replaced"]] == [0]
    rows = {r["case"]: r for r in summary["results"]}
    assert rows["trainer-backward"]["detect_ms"] and rows["trainer-backward"]["resumed_ms"][0] > 0
    assert rows["trainer-backward"]["steps_redone"] >= 0 and rows["fsdp-reference"]["overhead"] is not None
    assert (work / "selftest.md").read_text().count("| trainer-") == 3
    assert list(cwd.iterdir()) == []  # everything went into the work directory


def test_the_matrix_as_pytest_cases(tmp_path):
    """What a CI runner writes: pytest with the plugin, the selftest's own options in one flag. A
    selected case runs as a test (its job's baseline and reference first), one the options leave
    out is skipped saying so, and options the selftest refuses stop pytest with exit 2."""
    work = tmp_path / "work"
    pytest_ = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "replica.roles.selftest_pytest",
        "--pyargs",
        "replica.roles.selftest_pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
    ]
    done = subprocess.run(
        [*pytest_, "-k", "trainer-backward or two-trainers", f"--replica-selftest=--quick --steps 8 --report {work}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "1 passed, 1 skipped" in done.stdout and "not selected by the options" in done.stdout, done.stdout[-3000:]
    report = _job_report(work, "trainer-backward")
    assert report["faults"] and all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    assert sorted(p.name for p in work.iterdir()) == ["fsdp-reference", "fsdp-unmirrored", "trainer-backward"]
    refused = subprocess.run(
        [*pytest_, "--replica-selftest=--steps 3"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    said = refused.stdout + refused.stderr
    assert "--replica-selftest: replica selftest: error: --steps 3: the cases fire faults up to step 7" in said, said


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "torchdata")),
    reason="the Hugging Face job needs transformers and torchdata",
)
def test_a_planted_divergence_fails_the_run_and_names_its_case(tmp_path):
    """--unmirrored-noise: the Hugging Face job draws from a generator outside the mirrored
    state, so its redo after the kill differs from the reference: the selftest must say so."""
    done = _run("--case", "hf-optimizer", "--unmirrored-noise", "--report", str(tmp_path / "work"), cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-3000:]
    assert "replica selftest: hf-optimizer differs:" in done.stdout, done.stdout[-3000:]
    assert str(tmp_path / "work" / "hf-optimizer" / "run.log") in done.stdout  # the failed case names its log
    assert "0 of 1 cases bit-identical, 1 differ" in done.stdout, done.stdout[-3000:]
    report = _job_report(tmp_path / "work", "hf-optimizer")
    assert report["faults"][0]["fired_at"] is not None, "the kill did not fire"
    assert report["divergences"], "the divergence guard saw nothing"


def _bad_inputs() -> list[tuple[tuple[str, ...], str]]:
    cases = [
        (("--ray", "127.0.0.1:1"), "--ray 127.0.0.1:1: cannot reach the Ray head there"),
        (("--ray", "nonsense"), "need HOST:PORT"),
        (("--steps", "5"), "need --steps 8 or more"),
        (("--case", "trainer-nowhere"), "no case trainer-nowhere"),
        (("--trainers", "0"), "need an integer >= 1"),
        (("--agents", "1"), "the matrix needs 2 host agents or more"),
        (("--agents", "2", "--ray", "auto"), "--agents and --ray: pick one target"),
        (("--agents", "2"), f"--agents: set {envvars.TOKEN} to the secret the agents were started with"),
    ]
    if importlib.util.find_spec("ray") is None:
        cases[:2] = [(("--ray", "127.0.0.1:1"), "--ray needs Ray here")]
    return cases


@pytest.mark.parametrize("args,message", _bad_inputs())
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    done = _run(*args, "--report", str(tmp_path / "work"), cwd=tmp_path, timeout_s=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "work").exists()  # refused before anything started


def test_cuda_without_a_gpu_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = _run("--device", "cuda", "--quick", cwd=tmp_path, timeout_s=120)
    assert done.returncode == 2 and "--device cuda: this machine has no CUDA device" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_work_directory_in_use_is_refused(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "theirs.txt").write_text("not the selftest's")
    done = _run("--quick", "--report", str(tmp_path / "work"), cwd=tmp_path, timeout_s=120)
    assert done.returncode == 2 and "not an empty folder" in done.stderr, done.stderr
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["theirs.txt"]


def _processes_in(folder: Path) -> list[int]:
    """Processes whose working directory is inside ``folder`` (a case's launcher and its roles)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_ctrl_c_stops_every_process_it_started(tmp_path):
    """SIGINT (a terminal's Ctrl-C) in the middle of a case: exit 130, and the case's launcher
    and role processes are gone."""
    work = tmp_path / "work"
    # As from a terminal: SIGINT handled (a pytest-xdist worker ignores it, and exec keeps that).
    process = subprocess.Popen(
        [*SELFTEST, "--case", "trainer-backward", "--report", str(work)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = Deadline.after(timedelta(seconds=120))
        # Interrupted in the middle of its second run (the reference), with the case still to come.
        while len(_processes_in(work / "fsdp-reference")) < 3:
            assert process.poll() is None and not deadline.expired, process.stdout.read() if process.poll() else ""
            time.sleep(0.2)
        assert _processes_in(work), "no process of the case is running"
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-3000:]
    assert "interrupted; its processes are stopped" in output, output[-3000:]
    deadline = Deadline.after(timedelta(seconds=10))  # SIGKILLed: gone once the kernel reaps them
    while _processes_in(work) and not deadline.expired:
        time.sleep(0.1)
    assert _processes_in(work) == []


def test_a_durable_case_without_a_floor_is_skipped_saying_why(tmp_path):
    """Named (--case) without --durable: skipped with its reason, nothing launched."""
    plan = Plan(device=Device.CPU, num_trainers=2, steps=8, directory=tmp_path, case_timeout=timedelta(seconds=60))
    (result,) = run_matrix(plan, select_cases(quick=False, only=("trainer-and-standby",)), say=lambda _: None)
    assert result.outcome == "skipped" and "needs --durable DIR" in result.why, result
    assert list(tmp_path.iterdir()) == []


def test_case_selection():
    assert [c.name for c in select_cases(quick=True)] == ["trainer-backward", "standby-killed", "trainer-frozen"]
    durable = [c for c in CASES if c.durable]
    assert [c.name for c in durable] == ["trainer-and-standby"]
    assert select_cases(quick=False) == tuple(
        c for c in CASES if not c.durable and not c.min_agents
    )  # no floor, no agents
    assert select_cases(quick=False, durable=True) == tuple(c for c in CASES if not c.min_agents)
    assert select_cases(quick=False, durable=True, agents=True) == CASES
    assert [c.name for c in CASES if c.min_agents] == ["host-lost"]  # without agents, named: skipped saying why
    assert [c.name for c in select_cases(quick=True, durable=True)] == [
        "trainer-backward",
        "standby-killed",
        "trainer-frozen",
        "trainer-and-standby",
    ]
    assert [c.name for c in select_cases(quick=True, only=("two-trainers",))] == ["two-trainers"]
    with pytest.raises(ValueError, match="no case nope"):
        select_cases(quick=False, only=("nope",))
    assert {c.job for c in CASES} == {"fsdp", "hf", "rl"}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_full_matrix_on_this_machine(tmp_path):
    """Every case: the FSDP2 job's kills in each phase, a standby, a freeze, two trainers one
    after the other, a trainer with its standby (back to the floor); the Hugging Face job; the RL
    loop with vLLM engines where vLLM is installed."""
    done = _run("--report", str(tmp_path / "work"), "--durable", str(tmp_path / "floor"), cwd=tmp_path, timeout_s=1800)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "work" / "selftest.json").read_text())
    ran = {r["case"]: r for r in summary["results"]}
    skipped = {name for name, r in ran.items() if r["outcome"] == "skipped"}
    assert skipped <= {"hf-optimizer", "rl-trainer", "rl-rollout"}, skipped
    assert "host-lost" not in ran  # a host case runs on host agents only
    for case in select_cases(quick=False, durable=True):
        if case.name not in skipped:
            assert ran[case.name]["outcome"] == "bit-identical", ran[case.name]
            report = _job_report(tmp_path / "work", case.name)
            assert all(f["fired_at"] is not None for f in report["faults"]), (case.name, report["faults"])
    two = _job_report(tmp_path / "work", "two-trainers")["failovers"]
    assert [f["rank"] for f in two] == [0, 1], two
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("|")))
