"""Every role process `replica launch` starts dies with the launcher, even when the
launcher itself is killed with SIGKILL (PR_SET_PDEATHSIG, set before the script runs).
Also: the launcher's progress line never shares a line with other output."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from replica.roles.launch import StatusLines
from replica.roles.local_agent import die_with_launcher
from replica.timing import Deadline
from support.children import descendants, role_of
from support.launch import EXAMPLE, ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

_GET_PDEATHSIG = (
    "import ctypes, os, sys; v = ctypes.c_int(-1); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); "  # 2: PR_GET_PDEATHSIG
    "print(v.value, os.getppid(), sys.argv[1:])"
)


def _proc(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _alive(pid: int, started: int) -> bool:
    """Running (a zombie is dead; a recycled pid is another process)."""
    now = _proc(pid)
    return now is not None and now[1] == started and now[0] not in ("Z", "X")


def test_wrapped_command_runs_as_is_with_the_parent_death_signal_set():
    proc = subprocess.run(
        die_with_launcher([sys.executable, "-c", _GET_PDEATHSIG, "a b", "--c"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{signal.SIGKILL} {os.getpid()} ['a b', '--c']"


def test_a_child_whose_launcher_died_before_it_started_kills_itself():
    """The race PR_SET_PDEATHSIG leaves open: the launcher is gone before the child set
    it, so no signal will ever come. Here the child is told another launcher started it."""
    command = die_with_launcher([sys.executable, "-c", "print('the script ran')"])
    pid_at = command.index(str(os.getpid()))
    command[pid_at] = str(os.getpid() + 1_000_000)  # no process is that: not our parent
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "the script ran" not in proc.stdout, proc


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def _runs(pid: int, script: Path) -> bool:
    """The process runs ``script`` itself: ``python SCRIPT ...``, not the wrapper that will exec it."""
    return _cmdline(pid)[1:2] == [str(script)]


# Two jobs whose roles would outlive their launcher without the parent-death signal:
# * roles that never join (they never touch the job store, whose loss ends a waiting role),
# * the demo job, killed while trainer 0 is in a 600 s step (a stall fault): the store's loss
#   ends the other roles, not the stalled one.
_SLEEPER = "import time\ntime.sleep(600)\n"
_STALLED = ("--inject", "stall:trainer:0@2:600")


@pytest.mark.parametrize("start", ["forked", "exec"])
@pytest.mark.parametrize("job", ["sleeper", "stalled-trainer"])
def test_roles_die_with_a_killed_launcher(tmp_path, job, start):
    """SIGKILL `replica launch` while its 2 trainers and 2 standbys run; they must all be
    gone within 10 s: forked from the launcher's fork server (the default), or each a fresh
    interpreter (``--exec-roles``)."""
    script = EXAMPLE
    options: tuple[str, ...] = _STALLED
    if job == "sleeper":
        script, options = tmp_path / "sleeper.py", ()
        script.write_text(_SLEEPER)
    if start == "exec":
        options = (*options, "--exec-roles")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replica.roles.cli",
            "launch",
            "--steps",
            "100",
            "--timeout",
            "600",
            *options,
            str(script),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []

    def read() -> None:  # the roles write here too: they inherit the launcher's stdout and stderr
        for line in launcher.stdout:
            output.append(line)

    threading.Thread(target=read, daemon=True).start()

    def roles() -> dict[int, str]:
        """The processes below the launcher that run the script as a role. A forked one is named
        for its role once its parent-death signal is set; an exec'd one runs the script itself,
        past the wrapper that set the signal (whose command line names the script too) and past
        its exec (while the kernel builds the new image, /proc/PID/environ and cmdline read empty)."""
        found = {}
        for pid in descendants(launcher.pid):
            if start == "exec" and not _runs(pid, script):
                continue
            if (role := role_of(pid)) is not None:
                found[pid] = f"{role[0]} {role[1]}"
        return found

    children: dict[int, tuple[str, int]] = {}
    try:
        deadline = Deadline.after(timedelta(seconds=240))

        def ready() -> bool:
            if job == "stalled-trainer":  # trainer 0 sits in its stalled step
                return any("injected fault stall:trainer:0@2:600 fires" in line for line in list(output))
            return len(roles()) == 4

        while not ready():
            assert launcher.poll() is None, "the launcher ended early:\n" + "".join(output)[-4000:]
            assert not deadline.expired, "the job never got going:\n" + "".join(output)[-4000:]
            time.sleep(0.2)
        found = roles()
        assert sorted(found.values()) == ["standby 0", "standby 1", "trainer 0", "trainer 1"]
        children = {pid: _proc(pid) for pid in found}
        assert all(v is not None and _alive(pid, v[1]) for pid, v in children.items())

        os.kill(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=30) == -signal.SIGKILL  # the launcher was killed, not ended by itself

        deadline = Deadline.after(timedelta(seconds=10))
        while (
            left := [pid for pid, (_, started) in children.items() if _alive(pid, started)]
        ) and not deadline.expired:
            time.sleep(0.05)
        assert left == [], f"roles {[found[pid] for pid in left]} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid, (_, started) in children.items():
            if _alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_progress_line_stands_on_its_own_line():
    """The progress line (redrawn with "\\r") becomes whole lines, at most one a period,
    and the latest is shown before anything else is printed."""
    out = io.StringIO()
    lines = StatusLines(out, every_s=3600)
    with contextlib.redirect_stdout(lines):
        print("\rreplica: step 1/9", end="", flush=True)  # the first one: at once
        print("\rreplica: step 2/9", end="", flush=True)  # within the period: held
        print("\rreplica: step 3/9", end="", flush=True)
        print("\nreplica: trainer 1 is dead", flush=True)  # shows step 3 first, on a line of its own
        print("\nreplica: trainer 0 is dead", flush=True)  # no empty line: the line was ended
        print("\rreplica: step 9/9", end="", flush=True)
        print(flush=True)  # ends the job's progress: shows step 9
        print("done")
        print("\n\nfar below")  # a newline that ends nothing stays
    assert out.getvalue() == (
        "replica: step 1/9\nreplica: step 3/9\nreplica: trainer 1 is dead\n"
        "replica: trainer 0 is dead\nreplica: step 9/9\ndone\n\nfar below\n"
    )
