"""Failure domains and where standbys go: the two ways to map the standbys of many
trainer hosts onto rollout hosts, and how often two host losses at once are fatal
under each (a rank whose trainer and standby are both lost has no copy of its
last commit).

* ``Scheme.GROUP`` (copysets, as Gemini places its checkpoint replicas): every
  standby of trainer host ``i`` lives on one rollout host. Each trainer host has
  exactly one fatal partner.
* ``Scheme.SPREAD``: the standbys of one trainer host go to as many rollout hosts
  as it has ranks (``i``'s rank ``j`` on rollout host ``(i + j) mod R``). A rollout
  host's loss unprotects ranks of several trainer hosts, each one rank short.

``fatal_pairs`` counts, for a given assignment, the host pairs whose loss is fatal,
by enumeration (no closed form assumed); ``fatal_probability`` divides by all pairs.
docs/failover.md#failure-domains gives the numbers at 32 and 256 hosts and the choice.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import comb

__all__ = ["Layout", "Scheme", "exposed_after", "fatal_pairs", "fatal_probability", "layout", "pair_apart"]


class Scheme(enum.StrEnum):
    GROUP = "group"  # all standbys of one trainer host on one rollout host
    SPREAD = "spread"  # the standbys of one trainer host on as many rollout hosts as it has ranks


@dataclass(kw_only=True, frozen=True, slots=True)
class Layout:
    """Where each rank's trainer and standby run (host names), over all the job's hosts."""

    trainer: Mapping[int, str]
    standby: Mapping[int, str]
    hosts: Sequence[str]

    def __post_init__(self) -> None:
        if set(self.trainer) != set(self.standby):
            raise ValueError("every rank needs a trainer host and a standby host")
        unknown = (set(self.trainer.values()) | set(self.standby.values())) - set(self.hosts)
        if unknown:
            raise ValueError(f"hosts {sorted(unknown)} are not among the job's hosts")
        shared = sorted(r for r in self.trainer if self.trainer[r] == self.standby[r])
        if shared:
            raise ValueError(f"ranks {shared[:8]} have their standby on their trainer's host")


def layout(scheme: Scheme, *, trainer_hosts: int, rollout_hosts: int, ranks_per_host: int) -> Layout:
    """The assignment ``scheme`` makes for a job of ``trainer_hosts`` hosts of
    ``ranks_per_host`` ranks each and ``rollout_hosts`` rollout hosts (at least as many
    as trainer hosts for GROUP, at least ``ranks_per_host`` for SPREAD)."""
    if min(trainer_hosts, rollout_hosts, ranks_per_host) < 1:
        raise ValueError("need at least one trainer host, one rollout host and one rank per host")
    if scheme == Scheme.GROUP and rollout_hosts < trainer_hosts:
        raise ValueError(
            f"{Scheme.GROUP}: each of {trainer_hosts} trainer hosts needs a rollout host of its own "
            f"(got {rollout_hosts})"
        )
    if scheme == Scheme.SPREAD and rollout_hosts < ranks_per_host:
        raise ValueError(
            f"{Scheme.SPREAD}: {ranks_per_host} ranks a host need as many rollout hosts (got {rollout_hosts})"
        )
    trainers = [f"t{i}" for i in range(trainer_hosts)]
    rollouts = [f"r{i}" for i in range(rollout_hosts)]
    trainer, standby = {}, {}
    for i, j in itertools.product(range(trainer_hosts), range(ranks_per_host)):
        rank = i * ranks_per_host + j
        trainer[rank] = trainers[i]
        standby[rank] = rollouts[i if scheme == Scheme.GROUP else (i + j) % rollout_hosts]
    return Layout(trainer=trainer, standby=standby, hosts=trainers + rollouts)


def fatal_pairs(placed: Layout) -> int:
    """How many of the unordered pairs of distinct hosts, lost together, leave some rank
    with neither its trainer nor its standby."""
    fatal = {frozenset((placed.trainer[r], placed.standby[r])) for r in placed.trainer}
    return len(fatal)


def fatal_probability(placed: Layout) -> float:
    """The probability that two distinct hosts lost at random (every pair alike) are fatal."""
    return fatal_pairs(placed) / comb(len(placed.hosts), 2)


def exposed_after(placed: Layout, lost: str) -> set[str]:
    """The hosts whose loss, after ``lost`` (before its ranks have new copies), would be
    fatal: the other half of every rank that ``lost`` held one half of."""
    out = set()
    for rank in placed.trainer:
        pair = (placed.trainer[rank], placed.standby[rank])
        if lost in pair:
            out.add(pair[1] if pair[0] == lost else pair[0])
    return out


def pair_apart(trainer_domains: Sequence[str], site_domains: Sequence[str]) -> list[int] | None:
    """Which site each rank's standby takes: ``result[r]`` indexes ``site_domains`` (one site a
    standby, each taken once), never a site in rank ``r``'s trainer's domain
    (``trainer_domains[r]``); every rank whose own site ``r`` is allowed keeps it when some
    pairing lets them all. None when no pairing exists."""
    if len(site_domains) < len(trainer_domains):
        return None
    own = {r: r for r in range(len(trainer_domains)) if site_domains[r] != trainer_domains[r]}
    return _matched(trainer_domains, site_domains, own) or _matched(trainer_domains, site_domains, {})


def _matched(trainer_domains: Sequence[str], site_domains: Sequence[str], fixed: dict[int, int]) -> list[int] | None:
    """A bipartite matching of the ranks not in ``fixed`` (rank -> site) onto the sites it leaves
    free, by augmenting paths (Kuhn's algorithm), each rank trying its own site first."""
    free = [s for s in range(len(site_domains)) if s not in fixed.values()]
    taken: dict[int, int] = {}  # site -> rank

    def place(rank: int, seen: set[int]) -> bool:
        for site in sorted(free, key=lambda s: s != rank):
            if site in seen or site_domains[site] == trainer_domains[rank]:
                continue
            seen.add(site)
            if site not in taken or place(taken[site], seen):
                taken[site] = rank
                return True
        return False

    if not all(place(rank, set()) for rank in range(len(trainer_domains)) if rank not in fixed):
        return None
    where = {**fixed, **{rank: site for site, rank in taken.items()}}
    return [where[rank] for rank in range(len(trainer_domains))]
