"""Bad input to the ``replica`` commands gets one clear line and exit code 2 before anything
starts: no traceback, no usage dump, no role started (a launch that starts nothing ends at
once, and none of these may take as long as a job's start)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from support.launch import EXAMPLE, ROOT

CASES = {
    "a fault on a rank the job does not have": (["launch", "--inject", "kill:trainer:5@3", str(EXAMPLE)], "2 trainers"),
    "a fault on a step the job does not run": (
        ["launch", "--steps", "5", "--inject", "kill:trainer:1@9", str(EXAMPLE)],
        "steps 1 .. 5",
    ),
    "a fault on a standby that is not started": (
        ["launch", "--standbys", "1", "--inject", "kill:standby:1@2", str(EXAMPLE)],
        "1 standbys",
    ),
    "a fault on a rollout engine of a job without any": (
        ["launch", "--inject", "kill:rollout:0@2", str(EXAMPLE)],
        "0 rollouts",
    ),
    "negative steps": (["launch", "--steps", "-3", str(EXAMPLE)], "--steps"),
    "no trainers": (["launch", "--trainers", "0", str(EXAMPLE)], "--trainers"),
    "more standbys than trainers": (["launch", "--standbys", "3", str(EXAMPLE)], "one standby per trainer"),
    "a script that does not exist": (["launch", "nosuch.py"], "no such file"),
    "a port out of range": (["launch", "--port", "99999", str(EXAMPLE)], "0..65535"),
    "a timeout of zero": (["launch", "--timeout", "0", str(EXAMPLE)], "--timeout"),
    "a negative deadline": (["launch", "--heartbeat-deadline", "-1", str(EXAMPLE)], "--heartbeat-deadline"),
    "a report in a folder that does not exist": (
        ["launch", "--report", "/nonexistent/run.json", str(EXAMPLE)],
        "does not exist",
    ),
    "an unknown backend": (["launch", "--backends", "ucx,carrier-pigeon", str(EXAMPLE)], "carrier-pigeon"),
    "a coordinator of no trainers": (["coordinator", "--world-size", "0", "--steps", "3"], "--world-size"),
    "spares with no agent to start them": (
        ["coordinator", "--world-size", "2", "--steps", "3", "--spares", "1"],
        "--spares needs --agents",
    ),
    "an agent of a negative index": (["agent", "--store", "127.0.0.1:1", "--index", "-1", str(EXAMPLE)], "--index"),
    "a report that is not JSON": (["compare", "{bad}", "{bad}"], "not a replica job report"),
    "a JSON file that is not a report": (["compare", "{other}", "{other}"], "not a replica job report"),
    "a report that does not exist": (["compare", "/nonexistent.json", "/nonexistent.json"], "no such file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, case):
    argv, why = CASES[case]
    bad, other = tmp_path / "bad.txt", tmp_path / "other.json"
    bad.write_text("not json at all")
    other.write_text(json.dumps({"a": 1}))
    argv = [a.format(bad=bad, other=other) for a in argv]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "replica.roles.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=None,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"replica {argv[0]}: error: ") and why in lines[0], lines[0]
    assert "job store at" not in proc.stdout, "the job started before the input was checked"
    assert time.monotonic() - start < 60
