"""A script forked from the preloaded server (``replica.processes.start_script``) runs as
``python SCRIPT`` would, reports its status as ``subprocess.Popen`` does, and dies with the
process that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replica.processes import start_script
from support.children import descendants, process_state, wait_for

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the fork server's children are Linux only"
)

# What a script sees of its start, written as JSON to argv[1]; then it ends as argv[2] says.
_SCRIPT = """
import atexit, json, os, sys, threading, time
import multiprocessing as mp

def square(x):  # run in a spawned child: found again through this script, as `python SCRIPT` allows
    return x * x

def write_late(path):
    time.sleep(0.3)
    with open(path, "w") as f:
        f.write("joined")

if __name__ == "__main__":
    out, end = sys.argv[1], sys.argv[2]
    with mp.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(square, [3])
    forked = mp.get_context("fork").Process(target=time.sleep, args=(0,))  # a DataLoader's workers do this
    forked.start()
    forked.join()
    seen = {"start_method": mp.get_start_method(), "parent": mp.parent_process(), "name": __name__,
            "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
            "given": os.environ.get("GIVEN"), "parent_only": os.environ.get("PARENT_ONLY"),
            "comm": open("/proc/self/comm").read().strip(), "spawned": spawned, "forked": forked.exitcode,
            "torch_preloaded": "torch" in sys.modules}
    with open(out, "w") as f:
        json.dump(seen, f)
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    threading.Thread(target=write_late, args=(out + ".thread",)).start()  # not daemonic: waited for
    if end == "raise":
        raise RuntimeError("the script failed")
    if end.startswith("exit"):
        sys.exit(int(end[4:]))
    if end == "sleep":
        time.sleep(600)
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "scripts" / "job.py"
    path.parent.mkdir()
    path.write_text(_SCRIPT)
    return path


def test_a_script_runs_as_python_would_run_it(tmp_path, script, monkeypatch):
    monkeypatch.setenv("PARENT_ONLY", "1")
    out = tmp_path / "seen.json"
    proc = start_script(
        [str(script), str(out), "exit0"], env={"GIVEN": "yes", "PATH": os.environ["PATH"]}, name="trainer 3"
    )
    assert proc.wait(timeout=120) == 0 and proc.returncode == 0 and proc.poll() == 0
    seen = json.loads(out.read_text())
    assert seen == {
        "start_method": "fork",
        "parent": None,
        "name": "__main__",
        "argv": [str(script), str(out), "exit0"],
        "path0": str(script.parent),
        "cwd": os.getcwd(),
        "given": "yes",
        "parent_only": None,
        "comm": "trainer 3",
        "spawned": [9],
        "forked": 0,
        "torch_preloaded": True,
    }
    assert (tmp_path / "seen.json.atexit").read_text() == "ran"  # atexit handlers ran
    assert (tmp_path / "seen.json.thread").read_text() == "joined"  # a non-daemon thread was waited for


@pytest.mark.parametrize(("end", "status"), [("exit3", 3), ("raise", 1)])
def test_its_status_is_the_scripts(tmp_path, script, capfd, end, status):
    out = tmp_path / "seen.json"
    proc = start_script([str(script), str(out), end], env=dict(os.environ), name="standby 0")
    assert proc.wait(timeout=120) == status
    assert (tmp_path / "seen.json.atexit").read_text() == "ran"
    if end == "raise":  # as the interpreter prints it
        assert "RuntimeError: the script failed" in capfd.readouterr().err


def test_a_killed_script_reads_as_popen_reads_it(tmp_path, script):
    out = tmp_path / "seen.json"
    proc = start_script([str(script), str(out), "sleep"], env=dict(os.environ), name="rollout 0")
    wait_for(out.exists, "the script's start", timeout_s=120)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_killing_a_script_gone_before_its_exit_is_read_is_nothing(tmp_path, script):
    """The fork server reaps its children: a script's pid is gone (and may be another
    process's) before its exit reaches the starter. kill() then neither raises nor signals
    anything by that pid (a launcher killing a role declared dead that had just exited
    crashed with ProcessLookupError)."""
    from replica.roles.local_agent import LocalAgent

    out = tmp_path / "seen.json"
    proc = start_script([str(script), str(out), "exit0"], env=dict(os.environ), name="standby 0")
    wait_for(lambda: not os.path.exists(f"/proc/{proc.pid}"), "the server to reap the script", timeout_s=120)
    assert proc.wait(timeout=30) == 0
    agent = LocalAgent(script=[str(script)], env=dict(os.environ), replacements=0)
    agent.procs[proc.pid] = ("standby", proc)
    # The race: reaped by the server, its exit not arrived here yet (a sentinel with nothing to read).
    popen = proc._process._popen
    quiet, never_written = os.pipe()
    popen.returncode, sentinel, popen.sentinel = None, popen.sentinel, quiet
    try:
        assert proc.poll() is None
        proc.kill()  # no ProcessLookupError, and nothing sent to whatever has that pid now
        agent.kill(proc.pid)
    finally:
        popen.returncode, popen.sentinel = 0, sentinel
        os.close(quiet)
        os.close(never_written)


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError):
        start_script([], env={}, name="x")
    with pytest.raises(FileNotFoundError, match="no script"):
        start_script([str(tmp_path / "missing.py")], env={}, name="x")


# Starts the script given in argv[2:] and prints its pid; argv[1]: "forked" (the server a fork of the
# starter, start_server), "threaded" (start_server with a thread running: the exec'd server) or "execd".
_STARTER = """
import os, sys, threading, time
from replica.processes import start_script, start_server
if sys.argv[1] == "threaded":
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
forked = start_server() if sys.argv[1] != "execd" else None
proc = start_script(sys.argv[2:], env=dict(os.environ), name="trainer 0")
print(proc.pid, forked, flush=True)
if sys.argv[-1] == "sleep":
    time.sleep(600)
print(proc.wait(timeout=120), flush=True)
"""


def _server_of(pid: int) -> tuple[int, str]:
    """The parent of a script (its fork server): pid and name."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return ppid, Path(f"/proc/{ppid}/comm").read_text().strip()


@pytest.mark.parametrize(("mode", "forked"), [("forked", True), ("threaded", False)])
def test_a_server_forked_from_its_starter_runs_scripts_as_the_execd_one(tmp_path, script, mode, forked):
    """start_server: a command's fork (no interpreter started again) where it runs no other
    thread; the exec'd server where it does. The script sees the same either way."""
    out = tmp_path / "seen.json"
    done = subprocess.run(
        [sys.executable, "-c", _STARTER, mode, str(script), str(out), "exit0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GIVEN": "yes"},
    )
    assert done.returncode == 0, done.stderr
    started, status = done.stdout.splitlines()
    assert started.split()[1] == str(forked) and status == "0"
    seen = json.loads(out.read_text())
    assert {
        k: seen[k]
        for k in ("start_method", "parent", "name", "path0", "given", "comm", "spawned", "forked", "torch_preloaded")
    } == {
        "start_method": "fork",
        "parent": None,
        "name": "__main__",
        "path0": str(script.parent),
        "given": "yes",
        "comm": "trainer 0",
        "spawned": [9],
        "forked": 0,
        "torch_preloaded": True,
    }
    assert (tmp_path / "seen.json.atexit").read_text() == "ran"


@pytest.mark.parametrize("mode", ["execd", "forked"])
def test_a_script_dies_with_the_process_that_started_it(tmp_path, script, mode):
    """Its starter SIGKILLed: the starter's fork server (exec'd, or the starter's fork) exits and
    the script gets its parent-death signal."""
    out = tmp_path / "seen.json"
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, mode, str(script), str(out), "sleep"], stdout=subprocess.PIPE, text=True
    )
    pid = 0
    try:
        pid = int(starter.stdout.readline().split()[0])
        wait_for(out.exists, "the script's start", timeout_s=120)
        assert pid in descendants(starter.pid)
        server, name = _server_of(pid)
        assert (name == "replica-forks") == (mode == "forked"), name
        starter.kill()
        starter.wait(timeout=30)
        wait_for(
            lambda: not _running(pid) and not _running(server), "the script's and its server's death", timeout_s=10
        )
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        if pid and _running(pid):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return process_state(pid) not in ("Z", "X")
    except OSError:
        return False
