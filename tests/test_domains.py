"""Where standbys go (replica.roles.domains): the fatal host pairs of each scheme, counted
against a brute force over every pair of hosts, and the numbers docs/failover.md gives."""

from __future__ import annotations

import itertools

import pytest

from replica.roles.domains import Layout, Scheme, exposed_after, fatal_pairs, fatal_probability, layout, pair_apart


def _fatal_by_brute_force(placed: Layout) -> int:
    """Every pair of hosts lost together; fatal when some rank had both its halves there."""
    return sum(
        any({placed.trainer[r], placed.standby[r]} <= {a, b} for r in placed.trainer)
        for a, b in itertools.combinations(placed.hosts, 2)
    )


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


# --- the rule, enforced: a standby never in its trainer's failure domain ---

TOKEN = b"domains-test-token"


def _join(coord, role: str, rank: int, host: str, domain: str = "") -> object:
    """Post a signed join as a role on ``host`` would, let the coordinator answer, return the reply."""
    from replica.jobstore import keys
    from replica.roles.join import JoinRequest, post_request

    seq = post_request(
        coord.store,
        JoinRequest(
            role=role, rank=rank, host=host, pid=1000 + seq_of(coord), nonce=f"{role}-{rank}-{host}", domain=domain
        ),
        TOKEN,
    )
    decisions = coord.poll()
    return coord.store.get(keys.join_reply(seq)), decisions


def seq_of(coord) -> int:
    return len(coord.members) + len(coord.refused)


def test_a_standby_in_its_trainers_domain_fails_the_job_before_it_starts():
    from replica.roles.coordinator import Coordinator, DecisionKind

    coord = Coordinator(world_size=2, token=TOKEN, shared_domains=False)
    try:
        for rank, host in enumerate(("t0", "t1")):
            assert _join(coord, "trainer", rank, host)[0].admitted
        reply, _ = _join(coord, "standby", 1, "r1", domain="rack-b")  # another host, another domain
        assert reply.admitted
        reply, _ = _join(coord, "standby", 0, "r0", domain="t0")  # another host, but named into t0's domain
        assert not reply.admitted
        assert "failure domain 't0'" in reply.reason and "both copies of rank 0" in reply.reason
        assert "--allow-shared-domain" in reply.reason
        (decision,) = coord.poll()
        assert decision.kind == DecisionKind.FAILED and decision.usage and decision.rank == 0
        assert coord.poll() == []  # failed once
    finally:
        coord.close()


def test_after_the_first_commit_a_misplaced_standby_is_only_refused_and_shared_domains_admit():
    from replica.roles.coordinator import Coordinator

    coord = Coordinator(world_size=1, token=TOKEN, shared_domains=False, resume_from=4)  # commit 4 exists
    try:
        assert _join(coord, "trainer", 0, "h1")[0].admitted
        reply, decisions = _join(coord, "standby", 0, "h1")
        assert not reply.admitted and "failure domain 'h1'" in reply.reason
        assert decisions == [] and coord.poll() == []  # the rank goes on unprotected; the job does not fail
    finally:
        coord.close()
    coord = Coordinator(world_size=1, token=TOKEN)  # shared_domains (a library caller's default)
    try:
        assert _join(coord, "trainer", 0, "h1")[0].admitted
        assert _join(coord, "standby", 0, "h1")[0].admitted
    finally:
        coord.close()


def test_a_job_failed_on_placement_ends_with_exit_code_2():
    from datetime import timedelta

    from replica.roles.coordinator import Coordinator
    from replica.roles.exits import ExitCode
    from replica.roles.supervise import JobSpec, supervise

    coord = Coordinator(world_size=1, token=TOKEN, shared_domains=False)
    try:
        _join(coord, "trainer", 0, "h1")
        _join(coord, "standby", 0, "h1")
        assert supervise(coord, JobSpec(steps=2, faults=(), timeout=timedelta(seconds=60))) == ExitCode.USAGE
    finally:
        coord.close()


def _without_allow() -> dict[str, str]:
    import os

    from replica import envvars

    return {k: v for k, v in os.environ.items() if k != envvars.ALLOW_SHARED_DOMAIN}


def test_the_commands_refuse_a_standby_beside_its_trainer_unless_allowed(tmp_path):
    import subprocess
    import sys

    from replica import envvars
    from support.launch import EXAMPLE, ROOT, launch_command

    env = _without_allow()
    proc = subprocess.run(
        launch_command(tmp_path, "--trainers", "1", steps=2),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "replica launch: error: every role of `replica launch` runs on this machine" in proc.stderr
    assert not (tmp_path / "run.json").exists()  # refused before anything started
    agent = [
        sys.executable,
        "-m",
        "replica.roles.cli",
        "agent",
        "--store",
        "127.0.0.1:1",
        "--index",
        "0",
        "--roles",
        "trainer:0,standby:1,standby:0",
        str(EXAMPLE),
    ]
    proc = subprocess.run(agent, cwd=ROOT, env={**env, envvars.TOKEN: "t"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "the trainer and the standby of rank 0 on one host" in proc.stderr, proc.stderr
    # Allowed by the option, the same job runs (the variable is not set).
    proc = subprocess.run(
        launch_command(tmp_path, "--trainers", "1", "--allow-shared-domain", steps=2),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_standbys_are_paired_out_of_their_trainers_domains():
    """pair_apart (Ray's first placement: which rollout machine each rank's standby takes):
    every standby out of its trainer's domain, a rank keeps its own machine where it may, and
    no pairing is said as None; checked against every permutation on small cases."""
    assert pair_apart(["a", "b"], ["c", "d"]) == [0, 1]  # nothing to move
    assert pair_apart(["a", "b"], ["a", "b"]) == [1, 0]  # crossed
    assert pair_apart(["a", "b", "c"], ["a", "x", "c"]) == [2, 1, 0]  # rank 1 keeps its machine
    assert pair_apart(["a", "a"], ["a", "b"]) is None  # two ranks, one machine outside their domain
    assert pair_apart(["a", "b"], ["c"]) is None  # fewer machines than ranks
    for trainers in itertools.product("ab", repeat=3):
        for sites in itertools.product("abc", repeat=3):
            paired = pair_apart(list(trainers), list(sites))
            possible = [
                p for p in itertools.permutations(range(3)) if all(sites[p[r]] != trainers[r] for r in range(3))
            ]
            if not possible:
                assert paired is None, (trainers, sites)
                continue
            assert paired is not None and sorted(paired) == [0, 1, 2], (trainers, sites, paired)
            assert all(sites[paired[r]] != trainers[r] for r in range(3)), (trainers, sites, paired)
            kept = {r for r in range(3) if sites[r] != trainers[r]}
            assert all(paired[r] == r for r in kept) or not any(all(p[r] == r for r in kept) for p in possible)
