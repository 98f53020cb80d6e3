"""The coordinator's loop, shared by ``replica launch`` (with a local agent that
starts and watches the role processes) and ``replica coordinator`` (alone, for
roles on other machines): admit joins, act on deaths, show progress, end the
job, print the failover timeline and write the report."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from replica.errors import FencedError
from replica.jobstore import ExportStatus, Number, keys
from replica.mirror.floor import check_version
from replica.roles import timing
from replica.roles.coordinator import Coordinator, Decision, DecisionKind
from replica.roles.env import Fault, Role
from replica.roles.exits import ExitCode
from replica.roles.probe import Verdict
from replica.roles.report import build_report, fill_from, print_timeline, summary_lines, write_timeline_png
from replica.roles.spares import SparePool
from replica.timing import Deadline, pause

__all__ = ["Agent", "JobSpec", "ReplacementWatch", "supervise"]

logger = logging.getLogger(__name__)
_FLOOR_LOOKUP = 256  # the versions looked up in the job store at once, going back from the newest


class Agent(Protocol):
    """What a local agent does for the loop: report exits, start replacements."""

    def exits(self) -> Sequence[tuple[int, int, str | None]]:
        """(pid, exit code, host: None for this machine) of role processes that exited since the last call."""
        ...

    def replace_standby(self, rank: int) -> bool:
        """Start a new standby for ``rank``; False when none may be started."""
        ...

    def replace_rollout(self, index: int) -> bool:
        """Start a new rollout engine ``index``; False when none may be started."""
        ...

    def kill(self, pid: int, host: str | None = None) -> None:
        """Make sure a process declared dead is dead (fencing)."""
        ...

    def running(self, pids: set[int]) -> bool:
        """True while any of these (the trainers') processes still runs here."""
        ...

    def silent_hosts(self, longer_than: timedelta) -> set[str]:
        """Hosts whose agent has not been heard from for longer than this (lost or cut off)."""
        ...

    def unaware_of_end(self) -> set[str]:
        """Hosts whose agent has not seen the job's end yet (none where the agent is this process)."""
        ...

    def probe(self, pid: int, host: str | None = None) -> tuple[Verdict, str]:
        """A second look at a role silent past its deadline: its process (or its host) as this
        agent sees it (``replica.roles.probe``)."""
        ...


@dataclass(kw_only=True, frozen=True, slots=True)
class JobSpec:
    steps: int
    faults: tuple[Fault, ...]
    timeout: timedelta
    report: Path | None = None
    timeline_png: Path | None = None
    # After a promotion or a standby's death, train on unprotected while the new standby starts
    # (False: commit() waits until the rank is protected again, so no new commit has a single copy).
    train_while_replacing: bool = False
    # Where the standbys write the last commit when a rank's state is lost (None: they do not).
    export_dir: Path | None = None
    first_step: int = 1  # a job resumed from an export of step N starts at N + 1
    # How many more times a job that fails before its first global commit may start again from its
    # start (supervise then returns ExitCode.RESTART); what the earlier attempts were, for the report.
    restarts_left: int = 0
    restarts: tuple[dict, ...] = ()
    # The job has a durable floor (--durable): a rank's lost state is not the job's end when the floor has a
    # complete version newer than this attempt's start (supervise then returns ExitCode.RESUME); and a rank
    # whose standby is being replaced trains on meanwhile (as train_while_replacing), backed by the floor.
    durable: bool = False
    # The reports of the job's earlier attempts (a resume from the floor): the steps they ran and this one
    # did not (up to the version it resumed from) are taken from them.
    earlier: tuple[dict, ...] = ()
    # Called with the floor's version the job goes back to, before the end of this attempt is announced
    # (``replica coordinator``'s host agents learn of the next attempt first: roles/attempts.py).
    next_attempt: Callable[[int], None] | None = None


class ReplacementWatch:
    """Ranks whose training waits for a new standby: one not up (no new registration) within
    ``wait`` has its rank marked unprotected until it comes, so training goes on unprotected
    instead of its trainer giving up on it (StandbyLostError after ``timing.STANDBY_WAIT``)
    and the job failing. Seen: a replacement's Ray worker, started at niceness 15 on a loaded
    machine, took over 2 minutes."""

    def __init__(self, coord: Coordinator, wait: timedelta = timing.REPLACEMENT_WAIT):
        self._coord, self._wait = coord, wait
        self._waiting: dict[int, tuple[float, object]] = {}  # rank -> (deadline, the registration then)
        self._next_look = 0.0

    def started(self, rank: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._waiting[rank] = (now + self._wait.total_seconds(), self._coord.record.registration(rank))

    def check(self, now: float | None = None) -> list[int]:
        """Mark the overdue ranks unprotected (until their standby joins); returns them."""
        now = time.monotonic() if now is None else now
        if not self._waiting or now < self._next_look:
            return []
        self._next_look = now + 1.0  # a store read per waiting rank, once a second (not every round)
        overdue = []
        for rank, (deadline, before) in list(self._waiting.items()):
            current = self._coord.record.registration(rank)
            if (current is not None and current != before) or rank in self._coord.unprotected:
                del self._waiting[rank]  # up (or unprotected already: nothing to wait for)
            elif now >= deadline:
                del self._waiting[rank]
                self._coord.set_unprotected(rank, until_standby_joins=True)
                overdue.append(rank)
        return overdue


def supervise(
    coord: Coordinator,
    spec: JobSpec,
    agent: Agent | None = None,
    *,
    leading: Callable[[], bool] | None = None,
    cancel: threading.Event | None = None,
    spares: SparePool | None = None,
) -> ExitCode:
    """Run the job to its end; returns the exit status (0: every rank finished).
    ``leading()`` (an elected coordinator's) is asked before every round: once it says
    no, another coordinator may lead, and this one stops at once, deciding nothing
    more and leaving the job as it is (ExitCode.DEPOSED). ``cancel`` (set by a driver that
    shuts the job down) ends the loop as a timeout does: the end is announced, the report written.
    ``spares``: standbys started ahead, bound to a rank that loses its standby before a new
    process is started for it."""
    deadline = Deadline.after(spec.timeout)
    shown, errors = spec.first_step - 1, 0
    status, failure, restart, resume, floor_step = ExitCode.FAILED, None, None, None, -1
    exits: list[tuple[int, int, str | None]] = []  # seen by the agent, not yet taken in (kept until they are)
    decisions: list[Decision] = []
    replacing = ReplacementWatch(coord)
    if agent is not None:
        coord.probe = lambda member: agent.probe(member.pid, member.host)

    def take_exits() -> None:  # one at a time: an exit is never lost to a failure while it is handled
        while exits:
            pid, code, host = exits[0]
            if spares is None or not spares.exited(pid, host):  # a spare not bound yet is no member
                decisions.extend(coord.process_exited(pid, code, host=host))
            exits.pop(0)

    while not deadline.expired:
        if cancel is not None and cancel.is_set():
            print("\nreplica: the job was shut down before its end", flush=True)
            break
        if leading is not None and not leading():
            print(
                "\nreplica: another coordinator leads now (this one was silent or cut off); this one stops", flush=True
            )
            return ExitCode.DEPOSED
        decisions.clear()
        exits.extend(agent.exits() if agent is not None else [])

        def hosts() -> None:
            if agent is not None:
                decisions.extend(coord.hosts_silent(agent.silent_hosts(coord.deadlines.trainer)))

        def overdue() -> None:
            for rank in replacing.check():
                print(
                    f"\nreplica: WARNING rank {rank}'s new standby is not up after "
                    f"{timing.REPLACEMENT_WAIT.total_seconds():g} s: rank {rank} trains UNPROTECTED until it is",
                    flush=True,
                )

        for work in (
            take_exits,
            hosts,
            lambda: decisions.extend(coord.poll()),
            overdue,
            spares.tick if spares is not None else lambda: None,
        ):
            try:
                work()
            except FencedError as exc:
                print(f"\nreplica: another coordinator leads now ({exc}); this one stops", flush=True)
                return ExitCode.DEPOSED
            except Exception:
                errors += 1
                if errors == 1 or errors % 100 == 0:
                    logger.exception("the coordinator's poll failed (%d times so far); going on", errors)
        for decision in decisions:
            if decision.kind == DecisionKind.FAILED and decision.state_lost and spec.durable and resume is None:
                version = _floor_version(coord, spec)
                if version is not None:  # nothing to export: every role starts again from the floor
                    floor_step = version
                    resume = f"{decision.reason}; the job goes back to the durable floor's version of step {version}"
                    continue
            failure = failure or _act(coord, decision, agent, spec, replacing, spares)
            if decision.restart and spec.restarts_left > 0:
                restart = decision.reason
            if decision.kind == DecisionKind.FAILED and decision.usage:
                status = ExitCode.USAGE  # set up wrong, before anything was committed
        if resume is not None:
            print(f"\nreplica: {resume} and replays from there", flush=True)
            status = ExitCode.RESUME
            break
        if restart is not None:
            print(
                f"\nreplica: {restart}; nothing was committed, so nothing is lost: the job starts again from its "
                f"start (restart {len(spec.restarts) + 1}, {spec.restarts_left - 1} more allowed)",
                flush=True,
            )
            status = ExitCode.RESTART
            break
        if failure is not None:
            print(f"\nreplica: {failure}", flush=True)
            break
        step = _progress(coord, spec.steps, shown)
        if step > shown:
            shown = step
            _show_progress(coord, shown, spec.steps)
        trainers = {m.pid for m in coord.members if m.role == Role.TRAINER}
        if coord.all_done() and (agent is None or not agent.running(trainers)):
            _show_progress(coord, shown, spec.steps)  # the last commit, which came after the last loss
            status = ExitCode.OK
            break
        pause(timing.SUPERVISE_POLL, cancel, deadline)
    else:
        print(f"\nreplica: the job did not finish within {spec.timeout.total_seconds():g} s", flush=True)
    print(flush=True)
    if status == ExitCode.RESUME and spec.next_attempt is not None:
        spec.next_attempt(floor_step)
    coord.finish()
    if status != ExitCode.RESUME:  # resuming: the agent stops every role, each starts again from the floor
        _linger(coord, agent)
    faults = [str(f) for f in spec.faults]
    for failover in coord.failovers:
        coord.observe(failover, faults)
    report = build_report(coord, steps=spec.steps, faults=faults, failure=None if resume else failure)
    report["restarts"] = list(spec.restarts)
    report["spares_bound"] = list(spares.bound) if spares is not None else []
    for earlier in spec.earlier:
        fill_from(report, earlier)
    print_timeline(coord.failovers)
    print("\n".join(summary_lines(report)), flush=True)
    if spec.report is not None:
        spec.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"replica: report written to {spec.report}")
    if spec.timeline_png is not None and coord.failovers and write_timeline_png(coord.failovers, spec.timeline_png):
        print(f"replica: timeline plotted in {spec.timeline_png}")
    return status


def _linger(coord: Coordinator, agent: Agent | None) -> None:
    """Keep the store up until the roles have seen the end and left, and every host agent has
    seen it (one cut off when the job ended learns of it once back), timing.FINISH_LINGER at
    most: a role or agent that found the store gone first would take the end for the
    coordinator's death (ExitCode.COORDINATOR_LOST)."""
    until = Deadline.after(timing.FINISH_LINGER)
    waiting: set[str] = set()
    while not until.expired:
        try:
            for pid, code, host in agent.exits() if agent is not None else ():
                coord.exited_after_end(pid, code, host=host)
            waiting = {str(m) for m in coord.still_here(timing.GONE_AFTER)}
            waiting |= {f"the agent of {host}" for host in (agent.unaware_of_end() if agent is not None else ())}
        except Exception as exc:  # noqa: BLE001 - the job is over; only the wait is cut short
            logger.debug("looking for roles still running after the end: %s", exc)
            return
        if not waiting:
            return
        pause(timing.SUPERVISE_POLL, deadline=until)
    logger.warning(
        "%s did not see the job's end within %g s; the coordinator stops all the same",
        ", ".join(sorted(waiting)),
        timing.FINISH_LINGER.total_seconds(),
    )


def _floor_version(coord: Coordinator, spec: JobSpec) -> int | None:
    """The durable floor's newest usable version (complete, its files read back and checked:
    an unusable one is said and the one before it tried), if it is newer than this attempt's
    start (a resume must make progress: a job that loses a rank again before a newer version
    ends). Recorded as the floor's latest: the version every role starts again from."""
    latest = coord.store.get(keys.floor_latest())
    if latest is None:
        return None
    for first in range(latest.value, spec.first_step - 1, -_FLOOR_LOOKUP):  # newest first, a slice of steps at a time
        steps = range(first, max(first - _FLOOR_LOOKUP, spec.first_step - 1), -1)
        for step, version in zip(steps, coord.store.get_many([keys.floor_version(s) for s in steps]), strict=False):
            if version is None:
                continue
            problem = check_version(version)
            if problem is None:
                coord.store.put(keys.floor_latest(), Number(value=step))
                return step
            print(
                f"\nreplica: WARNING the durable floor's version of step {step} is not usable ({problem}): "
                "trying the one before it",
                flush=True,
            )
    return None


def _act(
    coord: Coordinator,
    decision: Decision,
    agent: Agent | None,
    spec: JobSpec,
    replacing: ReplacementWatch,
    spares: SparePool | None = None,
) -> str | None:
    if decision.kind == DecisionKind.FAILED:
        exported = _export(coord, spec.export_dir) if decision.state_lost and spec.export_dir is not None else ""
        return f"the job failed: {decision.reason}{exported}"
    if decision.dead is not None and agent is not None:
        agent.kill(decision.dead.pid, decision.dead.host)  # declared dead on a missed deadline, it may still run
    if decision.kind == DecisionKind.ROLLOUT_LOST:
        replaced = agent is not None and agent.replace_rollout(decision.rank)
        if replaced:
            coord.rollout_replacement_started(decision.rank)
        print(
            f"\nreplica: {decision.dead} is dead ({decision.reason}); training goes on without it"
            + ("; a replacement is starting" if replaced else ""),
            flush=True,
        )
        return None
    what = "promoted its standby" if decision.kind == DecisionKind.PROMOTED else "training goes on"
    print(f"\nreplica: {decision.dead} is dead ({decision.reason}); {what}", flush=True)
    spare = spares.bind(decision.rank) if spares is not None else None
    # With a durable floor the rank is never without a copy to go back to, and a spare protects it again
    # soon: training does not wait for the new standby.
    go_on = spec.train_while_replacing or spec.durable or spare is not None
    if go_on:  # before the new standby can join and protect the rank again
        coord.set_unprotected(decision.rank, until_standby_joins=True)
    if spare is not None:
        print(
            f"replica: spare {spare} is rank {decision.rank}'s new standby; the rank is unprotected until it "
            "holds the rank's state, and training goes on meanwhile",
            flush=True,
        )
    elif agent is not None and agent.replace_standby(decision.rank):
        print(
            f"replica: rank {decision.rank} is unprotected until its new standby is up; "
            + (
                "training goes on meanwhile" + (", backed by the durable floor" if spec.durable else "")
                if go_on
                else f"training waits for it (up to {timing.REPLACEMENT_WAIT.total_seconds():g} s)"
            ),
            flush=True,
        )
        if not go_on:
            replacing.started(decision.rank)
    else:
        coord.set_unprotected(decision.rank)
        print(
            f"replica: WARNING rank {decision.rank} is UNPROTECTED: no standby is left for it; if its trainer "
            "dies the job fails",
            flush=True,
        )
    return None


def _export(coord: Coordinator, directory: Path) -> str:
    """Have every live standby write its version of the last commit to ``directory``
    (waiting up to EXPORT_WAIT for them); says what was written for the final message."""
    directory = directory.resolve()
    commit = coord.request_export(str(directory))
    if commit is None:
        return ""
    print(f"\nreplica: the standbys export commit {commit} to {directory} ...", flush=True)
    standbys = {m.rank for m in coord.alive(Role.STANDBY)}
    deadline = Deadline.after(timing.EXPORT_WAIT)
    while not deadline.expired and not standbys <= set(coord.exports(commit)):
        pause(timing.SUPERVISE_POLL, deadline=deadline)
    answers = coord.exports(commit)
    written = sorted(r for r, answer in answers.items() if answer.status == ExportStatus.WRITTEN)
    failed = {r: answer.error for r, answer in answers.items() if answer.status == ExportStatus.FAILED}
    lost = sorted(set(range(coord.world_size)) - set(answers))
    text = f"; commit {commit} of rank(s) {written} was exported to {directory}"
    if failed:
        text += f"; the export of rank(s) {sorted(failed)} failed ({failed})"
    if lost:
        text += (
            f"; rank(s) {lost} have no copy of it left, so `replica launch --resume {directory}` needs their "
            "files from elsewhere"
        )
    return text


def _show_progress(coord: Coordinator, step: int, total: int) -> None:
    print(
        f"\rreplica: step {step}/{total}  commit {coord.record.last()}  generation {coord.generation}  failovers "
        f"{len(coord.failovers)}  unprotected {sorted(coord.unprotected) or 'none'}",
        end="",
        flush=True,
    )


def _progress(coord: Coordinator, total: int, shown: int) -> int:
    step = shown
    while step < total and coord.store.has(keys.loss(0, step + 1)):
        step += 1
    return step
