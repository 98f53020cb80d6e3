"""`replica launch` end to end: coordinator + 2 trainers + 2 standbys running
examples/train_fsdp.py, faults injected in every phase of a step; every run's
per-step losses must equal the failure-free run bit for bit, and each fault
must have fired."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replica.roles.report import compare_reports

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


def launch(tmp_path: Path, *options: str, name: str = "run") -> tuple[int, dict, str]:
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "replica.roles.cli", "launch", "--steps", str(STEPS), "--timeout",
                           "240", "--report", str(report), *options, str(ROOT / "examples" / "train_fsdp.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert report.exists(), output[-4000:]
    return proc.returncode, json.loads(report.read_text()), output


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    code, report, output = launch(tmp_path_factory.mktemp("reference"), name="reference")
    assert code == 0, output[-4000:]
    assert report["failovers"] == [] and report["last_commit"] == STEPS
    return report


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", "commit", "mirror"])
def test_trainer_killed_in_each_phase(tmp_path, reference, phase):
    code, report, output = launch(tmp_path, "--inject", f"kill:trainer:1@5:{phase}")
    assert code == 0, output[-4000:]
    assert report["faults"][0]["fired_at"] is not None  # the fault fired
    (failover,) = report["failovers"]
    assert failover["rank"] == 1 and failover["commit"] in (3, 4)  # at most the step in flight is lost
    assert failover["timeline_ms"]["detect"] < 1000, failover  # kill -9 -> decision
    assert "resumed" in failover["timeline_ms"]
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS


def test_two_trainers_die_one_after_the_other(tmp_path, reference):
    code, report, output = launch(tmp_path, "--inject", "kill:trainer:1@3:backward,kill:trainer:0@7:forward")
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"])
    assert [f["rank"] for f in report["failovers"]] == [1, 0]
    assert compare_reports(reference, report) == []


def test_a_straggler_is_not_declared_dead(tmp_path, reference):
    code, report, output = launch(tmp_path, "--heartbeat-deadline", "1", "--inject", "stall:trainer:0@4:3")
    assert code == 0, output[-4000:]
    assert report["faults"][0]["fired_at"] is not None  # the 3 s stall happened ...
    assert report["failovers"] == []  # ... and a 1 s heartbeat deadline did not take it for dead
    assert compare_reports(reference, report) == []


def test_bad_inject_spec_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "replica.roles.cli", "launch", "--inject", "explode:trainer:1@3",
                           str(ROOT / "examples" / "train_fsdp.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "bad fault 'explode:trainer:1@3'" in proc.stderr


def test_second_coordinator_on_the_same_port_is_refused():
    from replica.roles.coordinator import Coordinator

    first = Coordinator(world_size=2)
    with pytest.raises(RuntimeError, match="is another coordinator running there"):
        Coordinator(world_size=2, port=first.port)


def test_standby_killed_then_its_trainer(tmp_path, reference):
    """A dead standby is replaced; its trainer re-sends the last snapshot to the
    replacement, which is later promoted when the trainer dies too."""
    code, report, output = launch(tmp_path, "--inject", "kill:standby:1@3,kill:trainer:1@8:backward")
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"])
    assert [s["rank"] for s in report["standbys_replaced"]] == [1]
    (failover,) = report["failovers"]
    assert failover["rank"] == 1 and failover["commit"] in (6, 7)
    assert compare_reports(reference, report) == []
