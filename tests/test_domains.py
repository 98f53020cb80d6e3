"""Where standbys go (replica.roles.domains): the fatal host pairs of each scheme, counted
against a brute force over every pair of hosts, and the numbers docs/failover.md gives."""

from __future__ import annotations

import itertools

import pytest

from replica.roles.domains import Layout, Scheme, exposed_after, fatal_pairs, fatal_probability, layout


def _fatal_by_brute_force(placed: Layout) -> int:
    """Every pair of hosts lost together; fatal when some rank had both its halves there."""
    return sum(any({placed.trainer[r], placed.standby[r]} <= {a, b} for r in placed.trainer)
               for a, b in itertools.combinations(placed.hosts, 2))


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize(("trainer_hosts", "rollout_hosts", "ranks"), [(4, 4, 2), (16, 16, 8), (5, 9, 3)])
def test_fatal_pairs_equal_a_brute_force_over_every_pair(scheme, trainer_hosts, rollout_hosts, ranks):
    placed = layout(scheme, trainer_hosts=trainer_hosts, rollout_hosts=rollout_hosts, ranks_per_host=ranks)
    assert len(placed.trainer) == trainer_hosts * ranks
    assert fatal_pairs(placed) == _fatal_by_brute_force(placed) > 0


@pytest.mark.parametrize(("hosts", "group", "spread"), [(32, 16 / 496, 128 / 496), (256, 128 / 32640, 1024 / 32640)])
def test_group_placement_is_as_many_times_safer_as_a_host_has_ranks(hosts, group, spread):
    """The numbers in docs/failover.md#failure-domains: half the hosts train, 8 ranks each."""
    g = layout(Scheme.GROUP, trainer_hosts=hosts // 2, rollout_hosts=hosts // 2, ranks_per_host=8)
    s = layout(Scheme.SPREAD, trainer_hosts=hosts // 2, rollout_hosts=hosts // 2, ranks_per_host=8)
    assert fatal_probability(g) == pytest.approx(group)
    assert fatal_probability(s) == pytest.approx(spread)
    assert fatal_pairs(s) == 8 * fatal_pairs(g)
    # A rollout host lost: under GROUP one trainer host's loss would now be fatal, under SPREAD eight.
    assert exposed_after(g, "r0") == {"t0"}
    assert len(exposed_after(s, "r0")) == 8
    assert exposed_after(g, "t3") == {"r3"}


def test_a_standby_on_its_trainers_host_or_an_unknown_host_is_refused():
    with pytest.raises(ValueError, match=r"ranks \[1\] have their standby on their trainer's host"):
        Layout(trainer={0: "a", 1: "b"}, standby={0: "b", 1: "b"}, hosts=["a", "b"])
    with pytest.raises(ValueError, match="not among the job's hosts"):
        Layout(trainer={0: "a"}, standby={0: "z"}, hosts=["a", "b"])
    with pytest.raises(ValueError, match="needs a rollout host of its own"):
        layout(Scheme.GROUP, trainer_hosts=4, rollout_hosts=3, ranks_per_host=2)
    with pytest.raises(ValueError, match="need as many rollout hosts"):
        layout(Scheme.SPREAD, trainer_hosts=4, rollout_hosts=3, ranks_per_host=8)
