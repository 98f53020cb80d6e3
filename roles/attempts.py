"""A job's next attempt: when a rank lost every copy of its state and the durable floor holds a
newer version than the attempt started from, every role starts again from that version, with a
fresh job state under the next attempt's prefix (``keys.attempt_prefix``) on the same store.

``replica launch`` starts every role itself (``roles/launch.py``). Under ``replica coordinator``
the host agents do: the coordinator names the attempt at the job's own prefix (``keys.attempt``,
before it ends the attempt before, so an agent that sees the end sees the attempt too); each agent
kills what it runs and waits for orders under the new prefix (``roles/host_agent.py``); the next
attempt's coordinator places every role of the attempt before on the agents still alive: on the
agent where it ran when that one is alive, else on another, never a standby in its trainer's
failure domain nor a trainer in its standby's (unless shared domains are allowed), the least
loaded agent first."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from replica.errors import JobStateError
from replica.jobstore import AgentInfo, Attempt, JobStore, keys
from replica.jobstore.commit import CommitRecord
from replica.roles import timing
from replica.roles.env import Role
from replica.roles.members import Member, MemberState
from replica.roles.remote_agents import RemoteAgents, replacement_site
from replica.roles.report import logged
from replica.timing import Deadline, pause

__all__ = ["Placed", "announce", "earlier_attempts", "ended_attempt", "last_placement", "place", "place_on_agents"]

_START_ORDER = {Role.ROLLOUT: 0, Role.STANDBY: 1, Role.TRAINER: 2}  # as start_roles: the slowest first
_PARTNER = {Role.TRAINER: Role.STANDBY, Role.STANDBY: Role.TRAINER}


@dataclass(kw_only=True, frozen=True, slots=True)
class Placed:
    """Role ``role`` of ``rank`` (an engine's index for a rollout) goes to host agent ``agent``."""

    role: Role
    rank: int
    agent: AgentInfo


def announce(store: JobStore, attempt: Attempt) -> None:
    """Name ``attempt`` as the job's attempt in progress (``store``: at the job's own prefix); it is
    kept at the attempt's own prefix too, first: how it began (``earlier_attempts``)."""
    store.attempt(attempt.number).put(keys.attempt(), attempt)
    store.put(keys.attempt(), attempt)


def ended_attempt(
    store: JobStore, *, world_size: int, steps: int, faults: Sequence[str], version: int, reason: str | None
) -> tuple[dict, dict]:
    """What the job's report keeps of an attempt (``store``: at its prefix) that went back to the
    floor's version of step ``version`` (``reason``: why): its entry among the restarts, and what
    its roles recorded (``report.logged``: the steps it ran that the next attempt does not run
    again, the faults that fired in it)."""
    report = logged(store, world_size=world_size, steps=steps, faults=list(faults))
    entry = {
        "reason": reason,
        "faults_fired": [f["fault"] for f in report["faults"] if f["fired_at"] is not None],
        "resumed_from_floor": version,
        "lost_commit": CommitRecord(store, world_size=world_size).last(),
    }
    return entry, report


def earlier_attempts(
    store: JobStore, number: int, *, world_size: int, steps: int, faults: Sequence[str]
) -> tuple[list[dict], list[dict]]:
    """``ended_attempt`` of each attempt before ``number`` (``store``: at the job's own prefix),
    from what it left in the store and how the attempt after it began (``announce``): their
    entries among the restarts, the oldest first, and their records, the newest first (as
    ``JobSpec.earlier`` takes them)."""
    restarts, earlier = [], []
    for ended in range(number):
        began = store.attempt(ended + 1).get(keys.attempt())
        if began is None:  # announce() wrote it before that attempt began
            raise JobStateError(f"attempt {ended + 1} has no (verified) record of how it began")
        entry, report = ended_attempt(
            store.attempt(ended),
            world_size=world_size,
            steps=steps,
            faults=faults,
            version=began.step,
            reason=began.reason,
        )
        restarts.append(entry)
        earlier.insert(0, report)
    return restarts, earlier


def last_placement(members: Iterable[Member], *, standbys: int) -> dict[tuple[Role, int], str]:
    """Where each role of an attempt ran last: (role, rank) -> the host of its newest member in
    that role (one alive before one declared dead; a promoted standby is its rank's trainer); a
    spare standby never bound is no role. Ranks 0 .. ``standbys`` - 1 have a standby all the same:
    one whose standby was promoted, the replacement not joined yet, gets one where it fits ("")."""
    chosen: dict[tuple[Role, int], Member] = {}
    for member in members:
        if member.rank < 0:
            continue
        key = (Role(member.role), member.rank)
        old = chosen.get(key)
        if old is None or (member.state == MemberState.ALIVE, member.since) > (
            old.state == MemberState.ALIVE,
            old.since,
        ):
            chosen[key] = member
    return {(Role.STANDBY, rank): "" for rank in range(standbys)} | {key: m.host for key, m in chosen.items()}


def place(
    last: dict[tuple[Role, int], str], live: Sequence[AgentInfo], *, shared_domains: bool
) -> tuple[list[Placed], list[tuple[Role, int]]]:
    """Every role of ``last`` on one of the ``live`` agents (the module says how), in the order to
    start them; and the roles no live agent can take."""
    by_host = {info.host: info for info in live}
    placed = {key: by_host[host] for key, host in last.items() if host in by_host}
    load = Counter(info.index for info in placed.values())
    unplaced = []

    def domain(info: AgentInfo) -> str:
        return info.domain or info.host

    for role, rank in sorted(set(last) - set(placed), key=lambda key: (-_START_ORDER[key[0]], key[1])):
        partner = _PARTNER.get(role)
        apart = (
            {domain(placed[(partner, rank)])}
            if partner is not None and not shared_domains and (partner, rank) in placed
            else set()
        )
        site = replacement_site(
            live,
            domain=domain,
            trainer_domains=apart,
            load=lambda info: load[info.index],
            order=lambda info: info.index,
        )
        if site is None:
            unplaced.append((role, rank))
            continue
        placed[(role, rank)] = site
        load[site.index] += 1
    ordered = sorted(placed.items(), key=lambda item: (_START_ORDER[item[0][0]], item[0][1]))
    return [Placed(role=role, rank=rank, agent=info) for (role, rank), info in ordered], unplaced


def place_on_agents(
    agents: RemoteAgents,
    last: dict[tuple[Role, int], str],
    *,
    expected: set[int],
    shared_domains: bool,
    within: timedelta = timing.ROLE_WAIT,
) -> list[tuple[Role, int]]:
    """Wait (``within`` at most) until the agents ``expected`` (those alive when the attempt before
    ended) serve this attempt, then order every role of ``last`` started (``place``); the roles
    no live agent could take."""
    deadline = Deadline.after(within)
    while not expected <= set(agents.agents()) and not deadline.expired:
        pause(timing.SUPERVISE_POLL, deadline=deadline)
    placed, unplaced = place(last, agents.live(), shared_domains=shared_domains)
    for role_placed in placed:
        agents.start_role(role_placed.agent.index, role_placed.role, role_placed.rank)
    return unplaced
