"""A job's next attempt after a return to the durable floor (replica.roles.attempts): where its
roles go on the host agents still alive, and its state apart from the attempt before's. The
whole path under host agents, across network-namespace hosts, is
tests/test_hosts.py::test_host_agents_start_every_role_again_from_the_floor_after_a_pair_loss."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.jobstore import AgentInfo, Attempt, JobStore, Number, attempt_prefix, keys
from replica.roles.attempts import last_placement, place
from replica.roles.env import Role
from replica.roles.members import Member, MemberState

TOKEN = b"attempts-test-token"


def _agent(index: int, domain: str = "") -> AgentInfo:
    return AgentInfo(index=index, host=f"h{index}", address=f"10.0.0.{index}", pid=100 + index, domain=domain)


def _member(id_: int, role: Role, rank: int, host: str, *, since: float, state=MemberState.ALIVE) -> Member:
    return Member(id=id_, role=role, rank=rank, host=host, pid=id_, generation=0, joined_at=since, since=since,
                  state=state)


def test_the_last_placement_takes_each_roles_newest_member_a_live_one_first():
    members = [
        _member(0, Role.TRAINER, 1, "h3", since=1.0, state=MemberState.DEAD),  # rank 1's standby promoted, then lost
        _member(1, Role.TRAINER, 1, "h1", since=0.5, state=MemberState.DEAD),  # the trainer it replaced
        _member(2, Role.TRAINER, 0, "h0", since=0.5),
        _member(3, Role.STANDBY, 0, "h2", since=0.4),
        _member(4, Role.STANDBY, 0, "h4", since=2.0, state=MemberState.DEAD),  # newer, but dead
        _member(5, Role.STANDBY, -1, "h4", since=0.4),  # a spare never bound
    ]
    assert last_placement(members) == {(Role.TRAINER, 1): "h3", (Role.TRAINER, 0): "h0", (Role.STANDBY, 0): "h2"}


def test_roles_stay_on_live_agents_and_the_lost_ones_go_apart_from_their_partner():
    last = {(Role.TRAINER, 0): "h0", (Role.TRAINER, 1): "h1", (Role.STANDBY, 0): "h2", (Role.STANDBY, 1): "h3",
            (Role.ROLLOUT, 0): "h3"}
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
