"""A job's next attempt after a return to the durable floor (replica.roles.attempts): where its
roles go on the host agents still alive, and its state apart from the attempt before's. The
whole path under host agents, across network-namespace hosts, is
tests/test_hosts.py::test_host_agents_start_every_role_again_from_the_floor_after_a_pair_loss."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.jobstore import AgentInfo, Attempt, JobStore, Number, Stamp, Text, attempt_prefix, keys
from replica.jobstore.commit import CommitRecord
from replica.roles.attempts import announce, earlier_attempts, last_placement, place
from replica.roles.env import Role
from replica.roles.members import Member, MemberState

TOKEN = b"attempts-test-token"


def _agent(index: int, domain: str = "") -> AgentInfo:
    return AgentInfo(index=index, host=f"h{index}", address=f"10.0.0.{index}", pid=100 + index, domain=domain)


def _member(id_: int, role: Role, rank: int, host: str, *, since: float, state=MemberState.ALIVE) -> Member:
    return Member(
        id=id_, role=role, rank=rank, host=host, pid=id_, generation=0, joined_at=since, since=since, state=state
    )


def test_the_last_placement_takes_each_roles_newest_member_a_live_one_first():
    members = [
        _member(0, Role.TRAINER, 1, "h3", since=1.0, state=MemberState.DEAD),  # rank 1's standby promoted, then lost
        _member(1, Role.TRAINER, 1, "h1", since=0.5, state=MemberState.DEAD),  # the trainer it replaced
        _member(2, Role.TRAINER, 0, "h0", since=0.5),
        _member(3, Role.STANDBY, 0, "h2", since=0.4),
        _member(4, Role.STANDBY, 0, "h4", since=2.0, state=MemberState.DEAD),  # newer, but dead
        _member(5, Role.STANDBY, -1, "h4", since=0.4),  # a spare never bound
    ]
    last = last_placement(members, standbys=2)
    # Rank 1's standby was promoted and its replacement had not joined: it gets one all the same, apart.
    assert last == {(Role.TRAINER, 1): "h3", (Role.TRAINER, 0): "h0", (Role.STANDBY, 0): "h2", (Role.STANDBY, 1): ""}
    placed, unplaced = place(last, [_agent(0), _agent(2), _agent(3)], shared_domains=False)
    where = {(p.role, p.rank): p.agent.index for p in placed}
    assert unplaced == [] and where[(Role.TRAINER, 1)] == 3 and where[(Role.STANDBY, 1)] in (0, 2), where


def test_roles_stay_on_live_agents_and_the_lost_ones_go_apart_from_their_partner():
    last = {
        (Role.TRAINER, 0): "h0",
        (Role.TRAINER, 1): "h1",
        (Role.STANDBY, 0): "h2",
        (Role.STANDBY, 1): "h3",
        (Role.ROLLOUT, 0): "h3",
    }
    live = [_agent(0), _agent(2), _agent(4)]  # h1 and h3 are lost: rank 1's pair and engine 0
    placed, unplaced = place(last, live, shared_domains=False)
    where = {(p.role, p.rank): p.agent.index for p in placed}
    assert unplaced == []
    assert where[(Role.TRAINER, 0)] == 0 and where[(Role.STANDBY, 0)] == 2  # kept where they ran
    assert where[(Role.TRAINER, 1)] == 4  # the least loaded live agent
    assert where[(Role.STANDBY, 1)] in (0, 2)  # never beside its trainer
    assert [p.role for p in placed] == [Role.ROLLOUT, Role.STANDBY, Role.STANDBY, Role.TRAINER, Role.TRAINER]


def test_a_standby_that_only_its_trainers_domain_could_take_is_not_placed_unless_shared():
    last = {(Role.TRAINER, 0): "h0", (Role.STANDBY, 0): "h1"}
    live = [_agent(0, domain="rack-a"), _agent(2, domain="rack-a")]
    placed, unplaced = place(last, live, shared_domains=False)
    assert [(p.role, p.agent.index) for p in placed] == [(Role.TRAINER, 0)] and unplaced == [(Role.STANDBY, 0)]
    placed, unplaced = place(last, live, shared_domains=True)
    assert {(p.role, p.agent.index) for p in placed} == {(Role.TRAINER, 0), (Role.STANDBY, 2)} and unplaced == []


def test_each_attempt_has_a_state_of_its_own_named_at_the_jobs_prefix():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    job = JobStore(raw, token=TOKEN)
    job.put(keys.floor_latest(), Number(value=6))
    second = job.attempt(1)
    assert second.prefix == attempt_prefix(job.prefix, 1) != job.prefix
    assert second.get(keys.floor_latest()) is None  # a fresh state
    second.put(keys.floor_latest(), Number(value=9))
    assert job.get(keys.floor_latest()).value == 6 and second.get(keys.floor_latest()).value == 9
    job.put(keys.attempt(), Attempt(number=1, step=6, directory="/floor", fired=("kill:trainer:1@8",)))
    assert JobStore(raw, token=TOKEN).get(keys.attempt()).fired == ("kill:trainer:1@8",)
    assert JobStore(raw, token=b"another-job").get(keys.attempt()) is None  # signed: another token reads nothing
    assert job.attempt(0).prefix == job.prefix
    with pytest.raises(ValueError):
        attempt_prefix("replica", -1)


def test_the_attempts_before_a_later_one_are_read_back_from_the_store():
    """What a coordinator that took a later attempt over reports of the earlier ones (the one that
    ran them is gone): their steps, faults and commits from their own prefixes, how each ended from
    how the next began (``announce`` keeps each attempt's record at its own prefix)."""
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    job = JobStore(raw, token=TOKEN)
    fault = "kill:trainer:0@3:backward"
    first, second = job.attempt(0), job.attempt(1)
    for step in (1, 2, 3):
        first.put(keys.loss(0, step), Text(value=f"{float(step).hex()} {step}.5"))
    first.put(keys.killed(fault), Stamp(at=7.0))
    CommitRecord(first, world_size=1).seed(3)
    announce(job, Attempt(number=1, step=2, directory="/floor", fired=(fault,), reason="rank 0's state is lost"))
    second.put(keys.loss(0, 3), Text(value=f"{(3.0).hex()} 9.5"))
    announce(job, Attempt(number=2, step=2, directory="/floor", fired=(fault,), reason="lost again"))
    assert job.get(keys.attempt()).number == 2 and second.get(keys.attempt()).reason == "rank 0's state is lost"
    restarts, earlier = earlier_attempts(job, 2, world_size=1, steps=3, faults=[fault])
    assert restarts == [
        {"reason": "rank 0's state is lost", "faults_fired": [fault], "resumed_from_floor": 2, "lost_commit": 3},
        {"reason": "lost again", "faults_fired": [], "resumed_from_floor": 2, "lost_commit": None},
    ]
    assert [e["step_end_times"]["0"] for e in earlier] == [[None, None, 9.5], [1.5, 2.5, 3.5]]  # the newest first
    assert [e["faults"] for e in earlier] == [[{"fault": fault, "fired_at": None}], [{"fault": fault, "fired_at": 7.0}]]
    assert earlier_attempts(job, 0, world_size=1, steps=3, faults=[fault]) == ([], [])
