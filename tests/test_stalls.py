"""A stall is not a death. The coordinator discounts its own stalls, confirms a deadline death
through the agent's view of the process, and holds many members silent together as a
suspected stall; a frozen trainer is still convicted and failed over, bit-identically.

The stand-ins for a stall of the machine are deterministic: the coordinator's process, or
every role of the job, SIGSTOPped for 3 s (longer than the 2.5 s deadline)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from replica.jobstore import JobStore
from replica.roles.probe import ProcessState, Verdict, judge, look, verdict_of
from replica.roles.remote_agents import RemoteAgents
from replica.roles.report import compare_reports
from replica.roles.stalls import StallLog
from support.children import descendants, process_state, role_of, wait_for
from support.launch import ROOT, launch, launch_command

FREEZE_S = 3.0  # longer than the 2.5 s trainer and standby deadlines
SLOW_STEP = "stall:trainer:0@3:4"  # trainer 0's step 3 takes 4 s more (its beats go on)


# --- the parts ---


def test_the_stall_log_discounts_only_the_gaps_between_polls():
    log = StallLog(after=timedelta(milliseconds=250), keep=timedelta(seconds=60))
    assert log.tick(100.0) is None and log.tick(100.02) is None  # polls 20 ms apart: no stall
    assert log.tick(100.2) is None  # a slow poll, up to 250 ms: its own work, not a stall
    stall = log.tick(103.2)  # 3 s without a poll
    assert stall is not None and stall.start == pytest.approx(100.45) and stall.end == 103.2
    assert log.silence(99.0, 104.0) == pytest.approx(5.0 - 2.75)  # the stall counts against nobody
    assert log.silence(100.5, 103.0) == 0.0  # silent only while the coordinator did not run
    assert log.silence(103.2, 104.0) == pytest.approx(0.8)  # after it, silence counts again
    assert log.summary() == {"count": 1, "total_s": 2.75, "longest_s": 2.75}
    log.tick(200.0)  # a minute and a half later: the old stall is forgotten, this gap is one
    log.tick(400.0)
    assert log.overlap(100.0, 104.0) == 0.0
    with pytest.raises(ValueError, match="0 < after < keep"):
        StallLog(after=timedelta(seconds=2), keep=timedelta(seconds=1))


def test_the_probe_tells_a_stopped_an_idle_a_running_and_a_gone_process_apart():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        views = {}
        wait_for(lambda: look(busy.pid).cpu_s > 0.05, "the busy process to use CPU")
        assert verdict_of(views, busy.pid)[0] == Verdict.STALLED  # runs: a stall, not a death
        os.kill(busy.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(busy.pid) == "T", "the SIGSTOP to land")
        assert verdict_of(views, busy.pid) == (Verdict.DEAD, "its process is stopped")
        assert verdict_of(views, idle.pid) == (Verdict.DEAD, "its process sleeps and uses no CPU")
        busy.kill()
        busy.wait()
        assert verdict_of(views, busy.pid) == (Verdict.GONE, "its process is gone")
        # CPU used between two looks makes a sleeping process a stalled one
        before = look(idle.pid)
        later = type(before)(pid=before.pid, state=ProcessState.SLEEPING, cpu_s=before.cpu_s + 0.5, at=before.at + 1)
        assert judge(before, later)[0] == Verdict.STALLED
    finally:
        for p in (busy, idle):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()


ROLE_SCRIPT = """
import os, time
if os.environ["REPLICA_ROLE"] == "trainer" and os.environ["REPLICA_RANK"] == "0":
    while True:  # a role that runs (a fork copying page tables, a long kernel)
        pass
time.sleep(600)  # one that only waits
"""


def test_a_host_agent_counts_only_the_stores_silence_not_its_own(server, tmp_path, monkeypatch):
    """A host agent gives the job up (COORDINATOR_LOST) when the store is silent for STORE_LOST,
    here 1 s. Neither the time it took to start its --roles before listening (seconds on a
    loaded machine: the fork server's first start imports torch) nor a stall of its own (its
    loop and its talker held up together, as a stopped or starved process is) is the store's
    silence: it goes on, and ends when the job does."""
    from replica.jobstore import Flag, keys
    from replica.roles import timing
    from replica.roles.exits import ExitCode
    from replica.roles.host_agent import HostAgent
    from replica.roles.local_agent import LocalAgent

    monkeypatch.setattr(timing, "STORE_LOST", timedelta(seconds=1))
    store = JobStore(server, token=b"a-token-for-the-agent-test")
    local = LocalAgent(script=[str(tmp_path / "unused.py")], env={}, replacements=0)
    agent = HostAgent(store=store, index=0, address="127.0.0.1", local=local)
    time.sleep(1.5)  # its --roles starting: longer than STORE_LOST
    looks, exits = local.looks, local.exits

    def held_up(real):
        def call():
            if agent._stalls.count == 0 and time.monotonic() - started > 0.5:
                time.sleep(1.5)  # both threads of the agent stop at once, for longer than STORE_LOST
            return real()

        return call

    monkeypatch.setattr(local, "looks", held_up(looks))
    monkeypatch.setattr(local, "exits", held_up(exits))
    ending = threading.Timer(4.0, lambda: store.put(keys.finished(), Flag()))
    started = time.monotonic()
    ending.start()
    try:
        assert agent.run() == ExitCode.OK
    finally:
        ending.cancel()
        agent.close()
    assert agent._stalls.count >= 1 and agent._stalls.longest_s > 1.0, agent._stalls.summary()  # the stall happened
    assert store.get(keys.agent_ended(0)) is not None


def test_a_host_agent_judges_its_processes_for_the_coordinator(server, tmp_path):
    """Across hosts the second channel is the host agent: `replica agent` writes its verdicts on
    the role processes it runs with its beats, and the coordinator's side (``RemoteAgents``)
    reads them: a running process is stalled, a stopped or idle one dead, a pid no agent runs
    unknown (the deadline decides), and every process of a host whose agent is silent gone."""
    script = tmp_path / "role.py"
    script.write_text(ROLE_SCRIPT)
    env = {**os.environ, "REPLICA_TOKEN": "a-token-for-the-probe-test"}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replica.roles.cli",
            "agent",
            "--store",
            f"127.0.0.1:{server.port}",
            "--index",
            "0",
            "--roles",
            "trainer:0,trainer:1",
            str(script),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        store = JobStore(server, token=env["REPLICA_TOKEN"].encode())
        agents = RemoteAgents(store, count=1, replacements=0, members=list)
        wait_for(lambda: agents.agents(), "the agent to register", timeout_s=120)
        host = agents.agents()[0].host
        roles = {}
        wait_for(
            lambda: (
                roles.update({role_of(p): p for p in descendants(agent.pid)})
                or {("trainer", 0), ("trainer", 1)} <= set(roles)
            ),
            "both roles to start",
            timeout_s=60,
        )
        busy, idle = roles[("trainer", 0)], roles[("trainer", 1)]

        def verdict(pid: int, expected: Verdict, what: str) -> str:
            wait_for(lambda: agents.probe(pid, host)[0] == expected, f"{what}: {agents.probe(pid, host)}")
            return agents.probe(pid, host)[1]

        assert "its process is running" in verdict(busy, Verdict.STALLED, "the running role")
        assert verdict(idle, Verdict.DEAD, "the idle role") == "its process sleeps and uses no CPU (its agent's look)"
        os.kill(idle, signal.SIGSTOP)
        wait_for(
            lambda: agents.probe(idle, host) == (Verdict.DEAD, "its process is stopped (its agent's look)"),
            "the agent to see the stop",
        )
        assert agents.probe(agent.pid, host) == (Verdict.UNKNOWN, "")  # not a role: no agent vouches for it
        assert agents.probe(busy, "another-host") == (Verdict.UNKNOWN, "")
        os.kill(agent.pid, signal.SIGSTOP)  # its host, as far as anyone can tell, is gone
        try:
            assert verdict(busy, Verdict.GONE, "the silent agent's role") == "its host's agent is silent too"
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        assert verdict(busy, Verdict.STALLED, "the role of the agent back").endswith("(its agent's look)")
    finally:
        pids = descendants(agent.pid)
        agent.kill()
        agent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


# --- the job ---


class Job:
    """`replica launch` of the example job (2 trainers, 2 standbys) in the background, its
    output (the launcher's and the roles') read as it comes."""

    def __init__(self, tmp_path, *options: str):
        self.report_path = tmp_path / "run.json"
        self.proc = subprocess.Popen(
            launch_command(tmp_path, *options), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self._out += chunk

    @property
    def output(self) -> str:
        return self._out.decode(errors="replace")

    def said(self, text: str) -> None:
        """Wait until the job's output says ``text`` (while it runs)."""
        wait_for(lambda: text in self.output or self.proc.poll() is not None, repr(text), timeout_s=180)
        assert self.proc.poll() is None, self.output[-4000:]

    def roles(self) -> list[int]:
        """The job's role processes (not the launcher's fork server)."""
        return [pid for pid in descendants(self.proc.pid) if role_of(pid) is not None]

    def finish(self) -> tuple[int, dict, str]:
        code = self.proc.wait(timeout=300)
        self._reader.join(10)
        assert self.report_path.exists(), self.output[-4000:]
        return code, json.loads(self.report_path.read_text()), self.output

    def close(self) -> None:
        for pid in [self.proc.pid, *self.roles()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _frozen(pids: list[int], seconds: float) -> float:
    """SIGSTOP every one of ``pids`` at once, SIGCONT them ``seconds`` later; when they stopped."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    wait_for(lambda: all(process_state(pid) == "T" for pid in pids), "every one to stop", timeout_s=2)
    time.sleep(seconds - (time.time() - stopped))
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    return stopped


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(*options: str) -> Job:
        jobs.append(Job(tmp_path, *options))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


def test_the_coordinator_stopped_for_longer_than_a_deadline_declares_no_death(job, reference):
    """The launcher (the coordinator and its liveness endpoint) SIGSTOPped for 3 s mid-run: when
    it runs again, every member's beats are 3 s old, but that span was the coordinator's own
    stall: no death, no failover, the same losses."""
    run = job("--inject", SLOW_STEP)  # the job is sure to run on for 4 s once it fires
    run.said(f"injected fault {SLOW_STEP}")
    _frozen([run.proc.pid], FREEZE_S)
    code, report, output = run.finish()
    assert code == 0, output[-4000:]
    assert report["coordinator_stalls"]["longest_s"] >= FREEZE_S - 0.5, report["coordinator_stalls"]  # it fired
    assert "replica: coordinator stalls: " in output and "counted against no member" in output
    assert report["failovers"] == [] and report["standbys_replaced"] == [], output[-4000:]
    assert compare_reports(reference, report) == []


def test_every_role_stopped_together_is_a_suspected_stall_not_four_deaths(job, reference):
    """Every role of the job (2 trainers, 2 standbys) SIGSTOPped together for 3 s, the
    coordinator running: all are silent past their deadline and all are stopped, but silent
    together they are a suspected stall, held, and heard again: no death."""
    run = job("--inject", SLOW_STEP)
    run.said(f"injected fault {SLOW_STEP}")
    roles = run.roles()
    assert len(roles) >= 4, roles
    _frozen(roles, FREEZE_S)
    code, report, output = run.finish()
    assert code == 0, output[-4000:]
    assert report["failovers"] == [] and report["standbys_replaced"] == [], output[-4000:]
    held = report["suspected_stalls"]
    assert held and all(s["together"] and s["outcome"] == "recovered" for s in held), held  # it fired, and ended
    assert "suspected stall" in output
    # the end of the run says it
    assert f"replica: suspected stalls: {len(held)} ({len(held)} recovered)" in output, output[-2000:]
    assert "replica: failovers: 0\n" in output
    assert compare_reports(reference, report) == []


def test_a_trainer_stopped_alone_is_still_convicted_and_failed_over(job, reference):
    """Trainer 1 alone SIGSTOPped for 8 s: silent past its deadline, its process stopped: dead,
    its standby promoted within the deadline plus the confirmation (4 s; 5x allowed under
    load); it wakes up replaced and stops by itself; the losses are the failure-free run's."""
    run = job("--inject", "freeze:trainer:1@3:backward")  # SIGSTOPs itself
    run.said("injected fault freeze:trainer:1@3")
    trainer = next(pid for pid in run.roles() if role_of(pid) == ("trainer", 1))
    wait_for(lambda: process_state(trainer) == "T", "trainer 1 to stop")
    time.sleep(8.0)
    with contextlib.suppress(ProcessLookupError):  # the launcher kills a member it declared dead (fencing)
        os.kill(trainer, signal.SIGCONT)
    code, report, output = run.finish()
    assert code == 0, output[-4000:]
    [failover] = report["failovers"]
    assert failover["rank"] == 1 and "its process is stopped" in failover["reason"], failover
    # fired -> decided: the 2.5 s deadline, the confirmation, a beat period and a poll
    assert 2.5 <= failover["timeline_ms"]["detect"] / 1e3 < 5 * 4.0, failover
    assert report["suspected_stalls"] == []
    assert f"replica: failovers: 1 (rank 1 from commit {failover['commit']})" in output
    assert "replica: suspected stalls: 0\n" in output
    assert compare_reports(reference, report) == []


def test_a_death_before_the_first_commit_restarts_the_job_from_its_start(tmp_path, reference):
    """Trainer 1 killed in the backward of step 1, before any global commit: nothing is lost (every
    role built the job's initial state), so the launcher starts the job again by itself, once,
    without the fault that fired; the run ends as the failure-free run did, bit for bit."""
    code, report, output = launch(tmp_path, "--inject", "kill:trainer:1@1:backward")
    assert code == 0, output[-4000:]
    [restart] = report["restarts"]
    assert restart["faults_fired"] == ["kill:trainer:1@1:backward"], restart  # it fired, in the first attempt
    assert "trainer 1 died" in restart["reason"] and "before the first global commit" in restart["reason"]
    assert "the job starts again from its start (restart 1, 0 more allowed)" in output
    assert report["failure"] is None and report["failovers"] == []
    assert compare_reports(reference, report) == []
    # --replacements 0 allows no restart: the job fails as before, saying why
    code, report, output = launch(
        tmp_path, "--replacements", "0", "--inject", "kill:trainer:1@1:backward", name="no-restart"
    )
    assert code == 1 and "before the first global commit" in report["failure"], output[-4000:]
    assert report["restarts"] == []
