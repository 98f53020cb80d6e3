"""The coordinator's side of the host agents (``replica agent``): their exit
reports come in as the local agent's do, replacements and kills go out as
orders. Which host gets a replacement: a live agent's (its beat rose within
``AGENT_SILENCE``) whose failure domain (``replica agent --domain``, else its host)
runs no trainer (standbys and engines belong on rollout machines, and never in
the domain of the trainer they protect), the one with the fewest live members,
then the lowest index."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TypeVar

from replica.jobstore import AgentInfo, AgentOrder, JobStore, OrderKind, keys
from replica.roles import timing
from replica.roles.env import Role
from replica.roles.probe import Verdict, by_host
from replica.roles.spares import Replacements
from replica.timing import Deadline, pause

__all__ = ["AGENT_SILENCE", "RemoteAgents", "kept_apart_from", "replacement_site"]

logger = logging.getLogger(__name__)

Site = TypeVar("Site")


def replacement_site(
    sites: Iterable[Site],
    *,
    domain: Callable[[Site], str],
    trainer_domains: set[str],
    load: Callable[[Site], int],
    order: Callable[[Site], object],
) -> Site | None:
    """Where a replacement standby or engine goes, among ``sites`` (hosts' agents, Ray nodes
    or bundles) that can take it: one in a failure domain (a host by default:
    ``replica.roles.env.domain_name``) where no trainer runs now, the least loaded, then the
    first in ``order``; None if there is none. The one placement rule of every launcher."""
    candidates = [s for s in sites if domain(s) not in trainer_domains]
    return min(candidates, key=lambda s: (load(s), order(s)), default=None)


def kept_apart_from(*, spare: bool) -> tuple[Role, ...]:
    """The roles whose failure domains a new standby or engine may not share: a trainer's; a
    spare's also a standby's (a promotion makes that domain a trainer's, beside the spare it may
    be bound to)."""
    return (Role.TRAINER, Role.STANDBY) if spare else (Role.TRAINER,)


# An agent that has not beaten (every 200 ms) for this long gets no new role: shorter than any
# role's deadline, so the agent of a host lost with a role is passed over when that role is replaced.
AGENT_SILENCE = timedelta(seconds=1)
_WATCH_EVERY = timedelta(milliseconds=100)  # how often exits() reads the agents' beats


class RemoteAgents:
    """``supervise.Agent`` for agents on other hosts. ``members()`` gives the live
    members as (role, rank, host, domain) for placement; ``replacements`` < 0: no limit."""

    def __init__(
        self,
        store: JobStore,
        *,
        count: int,
        replacements: int,
        members: Callable[[], list[tuple[str, int, str, str]]],
        trainers: int = 0,
    ):
        if count < 0:
            raise ValueError(f"need count >= 0, got {count}")
        self._store, self._count, self._members = store, count, members
        self._replacements = Replacements(replacements)
        self._trainers = trainers  # the job's trainer ranks: spares are placed once all are in (their domains)
        self._info: dict[int, AgentInfo] = {}
        self._beats: dict[int, tuple[int, float]] = {}  # index -> (beat, when it last rose, here)
        self._exits_seen: dict[int, int] = {}
        self._reported: set[tuple[str, int]] = set()
        self._spares: dict[tuple[str, int], int] = {}  # (host, pid) -> spare index, from the agents' exit reports
        self._next_watch = Deadline.now()  # exits() reads the agents' beats when this passed
        # Hosts where a member was declared dead with no exit its agent reported: perhaps lost whole,
        # their agent's beats still fresh; no new role goes there until AGENT_SILENCE shows it (host ->
        # when it was suspected, here).
        self._suspects: dict[str, float] = {}

    def agents(self) -> dict[int, AgentInfo]:
        """The agents registered so far."""
        for index in range(self._count):
            if (
                index not in self._info
                and (info := self._store.get(keys.agent(index))) is not None
                and info.index == index
            ):
                self._info[index] = info
                logger.info("agent %d registered: %s (%s)", index, info.host, info.address)
        return self._info

    def live(self) -> list[AgentInfo]:
        """The agents whose beat rose within AGENT_SILENCE (watched since they registered:
        ``exits()`` looks at the beats every round)."""
        self._watch_beats()
        now = time.monotonic()
        return [
            info for index, info in self.agents().items() if now - self._beats[index][1] < AGENT_SILENCE.total_seconds()
        ]

    def _watch_beats(self) -> None:
        now = time.monotonic()
        for index in self.agents():
            beat = self._store.get(keys.agent_beat(index))
            value = beat.value if beat is not None else 0
            if index not in self._beats or value != self._beats[index][0]:
                self._beats[index] = (value, now)

    # --- supervise.Agent ---

    def exits(self) -> list[tuple[int, int, str]]:
        if self._next_watch.expired:
            self._watch_beats()
            self._next_watch = Deadline.after(_WATCH_EVERY)
        out = []
        for index in self.agents():
            seen = self._exits_seen.get(index, 0)
            while (report := self._store.get(keys.agent_exit(index, seen + 1))) is not None:
                seen += 1
                if (report.host, report.pid) not in self._reported:  # an agent may report an exit twice
                    self._reported.add((report.host, report.pid))
                    if report.spare >= 0:
                        self._spares[(report.host, report.pid)] = report.spare
                    out.append((report.pid, report.code, report.host))
            self._exits_seen[index] = seen
        return out

    def replace_standby(self, rank: int) -> bool:
        return self._replace(Role.STANDBY, rank)

    def replace_rollout(self, index: int) -> bool:
        return self._replace(Role.ROLLOUT, index)

    def kill(self, pid: int, host: str | None = None) -> None:
        if host is not None and (host, pid) not in self._reported:
            # Found dead by its deadline or a peer's report, not by its agent: the host may be lost with it
            # (a transport report comes well before the agent's beats go stale).
            self._suspects[host] = time.monotonic()
        for info in self.agents().values():
            if info.host == host:
                self._order(info.index, AgentOrder(kind=OrderKind.KILL, pid=pid))

    def running(self, pids: set[int]) -> bool:
        return False  # none of the job's processes runs on the coordinator's machine

    def unaware_of_end(self) -> set[str]:
        """Hosts whose agent has not written that it saw the end, among those heard from within
        STORE_LOST (an agent silent longer has given the store up and stopped by itself)."""
        self._watch_beats()
        now, agents = time.monotonic(), self.agents()
        ended = self._store.get_many([keys.agent_ended(index) for index in agents])
        return {
            info.host
            for (index, info), flag in zip(agents.items(), ended, strict=False)
            if flag is None and index in self._beats and now - self._beats[index][1] < timing.STORE_LOST.total_seconds()
        }

    def silent_hosts(self, longer_than: timedelta) -> set[str]:
        self._watch_beats()
        now = time.monotonic()
        return {
            info.host
            for index, info in self.agents().items()
            if index in self._beats and now - self._beats[index][1] > longer_than.total_seconds()
        }

    def probe(self, pid: int, host: str | None = None) -> tuple[Verdict, str]:
        """Gone with its host when that host's agent is silent too; else its agent's latest
        verdict on the process (written with each beat, every ``AGENT_BEAT``); unknown when
        no agent of that host lists it."""
        verdict = by_host(host or "", self.silent_hosts(AGENT_SILENCE))
        if verdict[0] != Verdict.UNKNOWN:
            return verdict
        for index, info in self.agents().items():
            if (
                info.host == host
                and (looks := self._store.get(keys.agent_looks(index))) is not None
                and pid in looks.pids
            ):
                i = looks.pids.index(pid)
                return Verdict(looks.verdicts[i]), f"{looks.whys[i]} (its agent's look)"
        return verdict

    def start_spare(self, index: int) -> bool:
        """Order spare standby ``index`` started on a live agent in a failure domain without a
        trainer or a standby (``kept_apart_from``); False while there is none, or not every
        trainer has joined yet. Spares are not counted against the replacements; their refills
        are (``take_replacement``)."""
        if sum(role == Role.TRAINER for role, _, _, _ in self._members()) < self._trainers:
            return False  # not every trainer's domain is known yet
        chosen = self._site(spare=True)
        if chosen is None:
            return False
        self._order(chosen.index, AgentOrder(kind=OrderKind.START, role=str(Role.STANDBY), spare=index))
        logger.warning("asked agent %d (%s) to start spare standby %d", chosen.index, chosen.host, index)
        return True

    def start_role(self, index: int, role: Role, rank: int) -> None:
        """Order agent ``index`` to start ``role`` ``rank`` (a placed role of the job's next
        attempt: roles/attempts.py; not a replacement)."""
        self._order(index, AgentOrder(kind=OrderKind.START, role=str(role), rank=rank))
        logger.warning("asked agent %d to start %s %d", index, role, rank)

    def take_replacement(self) -> bool:
        return self._replacements.take()

    def spare_of(self, pid: int, host: str | None = None) -> int | None:
        return self._spares.get((host or "", pid))

    def _replace(self, role: Role, rank: int) -> bool:
        if self._replacements.left == 0:
            return False
        chosen = self._site()
        if chosen is None:
            logger.warning("no live agent in a failure domain without a trainer can start %s %d", role, rank)
            return False
        self.take_replacement()
        self._order(chosen.index, AgentOrder(kind=OrderKind.START, role=str(role), rank=rank))
        logger.warning("asked agent %d (%s) to start %s %d", chosen.index, chosen.host, role, rank)
        return True

    def _site(self, *, spare: bool = False) -> AgentInfo | None:
        """The live agent a new standby, spare or engine goes to: in a domain apart from
        ``kept_apart_from``'s roles, the one with the fewest members on its host, the lowest index
        first."""
        self._settle_suspects()
        members = self._members()
        trainer_domains = {domain for r, _, _, domain in members if r in kept_apart_from(spare=spare)}
        load = {}
        for _, _, host, _ in members:
            load[host] = load.get(host, 0) + 1
        return replacement_site(
            self.live(),
            domain=lambda info: info.domain or info.host,
            trainer_domains=trainer_domains,
            load=lambda info: load.get(info.host, 0),
            order=lambda info: info.index,
        )

    def _settle_suspects(self) -> None:
        """Wait out the suspicion of the hosts suspected within ``AGENT_SILENCE`` (a second at most):
        then ``live()`` tells a lost host (its agent silent since) from one whose process alone died."""
        now = time.monotonic()
        self._suspects = {
            host: at
            for host, at in self._suspects.items()
            if now - at < (AGENT_SILENCE + 2 * _WATCH_EVERY).total_seconds()
        }
        if self._suspects and any(info.host in self._suspects for info in self.live()):
            # Beats are read every _WATCH_EVERY: the last one of a lost host may be read that late.
            settle = Deadline.after(
                timedelta(seconds=max(self._suspects.values()) - now) + AGENT_SILENCE + 2 * _WATCH_EVERY
            )
            logger.info(
                "a member on %s died with no exit its agent reported: waiting %.2f s to see whether "
                "its host is lost before placing a role",
                ", ".join(sorted(self._suspects)),
                settle.remaining_s(),
            )
            pause(settle.remaining(), deadline=settle)
            self._suspects.clear()

    def _order(self, index: int, order: AgentOrder) -> None:
        n = self._store.count(keys.agent_orders(index), 1)
        self._store.put(keys.agent_order(index, n), order)
